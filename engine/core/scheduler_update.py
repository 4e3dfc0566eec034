"""Applying a finished step to the scheduler's state: `Scheduler.update` (core/scheduler.py) is `apply_step`.

After a forward pass: computed tokens advance (unless `commit_launch` did at launch), full blocks are
registered for prefix caching, sampled tokens (+ logprobs) are appended (or replace the overlapped loop's
PENDING_TOKEN) and the finish rules (core/finish.py) end requests.

Two paths with one result. The per-row path handles everything (MTP verify steps, rows out of batch order,
sequences finished or preempted since the step was scheduled). A plain decode-like step, where every
scheduled sequence samples one token in batch order and none changed state, takes the batch path: the
tokens are stored in one loop, blocks that became full are found with one comparison per row, and the
finish rules run only on the rows that may finish (`finish.token_rule_rows`) or that carry text or grammar
state. A row left out has no verdict and no side effect in the per-row path either, and the order of every
state change that can interact (block registration, finishing, grammar and detokenizer feeds) is kept, so
both paths leave the same state (tests/engine/test_scheduler_update.py).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import TYPE_CHECKING

from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.finish import Finish, FinishRules, token_rule_filter
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus

if TYPE_CHECKING:
    from deepinfer.engine.core.scheduler import Scheduler

_RUNNING, _FINISHED = SequenceStatus.RUNNING, SequenceStatus.FINISHED


def apply_step(sched: Scheduler, out: SchedulerOutput, runner_out: ModelRunnerOutput,
               launched: bool = False) -> list[Sequence]:
    """`Scheduler.update` (its docstring is the contract): returns the sequences this step finished, those a
    token rule ended, then those only a text rule ended, each group in batch order."""
    seqs = _batch_rows(sched, out, runner_out, launched)
    if seqs is not None:
        return _apply_batch(sched, out, seqs, runner_out, launched)
    return _apply_rows(sched, out, runner_out, launched)


def _batch_rows(sched: Scheduler, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                launched: bool) -> list[Sequence] | None:
    """The step's sequences when the batch path applies (nothing has been changed yet), else None."""
    if runner_out.spec_token_ids or type(sched.block_manager) is not BlockManager or \
            type(sched.finish_rules) is not FinishRules:
        return None
    if out.decode is not None:
        seqs = out.decode.seqs
    else:
        sched_rows = out.scheduled
        if len(out.sampled) != len(sched_rows):
            return None
        seqs = [s.seq for s in sched_rows]
    if len(runner_out.token_ids) != len(seqs) or (
            runner_out.seqs != seqs if runner_out.seqs is not None else  # identity first: no id pass
            [q.seq_id for q in seqs] != runner_out.seq_ids):
        return None
    if [q.status for q in seqs].count(_RUNNING) != len(seqs):
        return None   # finished from outside or preempted since launch: the per-row path handles them
    if launched:
        # Every row holds its placeholder (the per-row path raises the error when one does not).
        try:
            if [q.output_token_ids[-1] for q in seqs].count(PENDING_TOKEN) != len(seqs):
                return None
        except IndexError:   # a row without outputs
            return None
    return seqs


def _apply_batch(sched: Scheduler, out: SchedulerOutput, seqs: list[Sequence], runner_out: ModelRunnerOutput,
                 launched: bool) -> list[Sequence]:
    tokens, logprobs = runner_out.token_ids, runner_out.logprobs
    rules = sched.finish_rules
    p0 = seqs[0].params
    shared = rules.grammar_rows_only and all(map(operator.is_, (q.params for q in seqs), repeat(p0)))
    if launched:
        if not shared:   # else stored by _shared_params_pass
            for q, t in zip(seqs, tokens):
                q.output_token_ids[-1] = t
    else:
        d = out.decode
        if d is not None:
            for q, start in zip(seqs, d.starts):
                if q.num_computed_tokens != start:
                    sched._advance(ScheduledSequence(q, start, 1, True))   # raises
                q.num_computed_tokens = start + 1
        else:
            advance = sched._advance
            for s in out.scheduled:
                advance(s)
        for q, t in zip(seqs, tokens):
            q.output_token_ids.append(t)
    # Registration before any finish: mark_computed touches only a row's own unshared blocks and free() no
    # registration, so this order leaves the per-row path's state; among rows batch order is kept.
    if logprobs.count(None) != len(logprobs):
        for q, lp in zip(seqs, logprobs):
            if lp is not None:
                if q.logprobs is None:
                    q.logprobs = []
                q.logprobs.append(lp)
    if shared:
        rows = _shared_params_pass(sched, seqs, tokens, token_rule_filter(p0, rules.max_model_len))
    else:
        sched.block_manager.mark_computed_all(seqs)
        rows = rules.rows_to_check(seqs)
    finished: list[Sequence] = []
    text_finished: list[tuple[Sequence, str]] = []
    check = sched.finish_rules.check
    for i in rows:
        verdict = check(seqs[i])
        if verdict is not None:
            apply_verdict(sched, seqs[i], verdict, finished, text_finished)
    for seq, reason in text_finished:
        sched.finish(seq, reason)
        finished.append(seq)
    return finished


def _shared_params_pass(sched: Scheduler, seqs: list[Sequence], tokens: list[int],
                        rule: tuple[frozenset[int], bool, int, int]) -> list[int]:
    """One pass over a batch sharing one SamplingParams: resolve each placeholder (a no-op for tokens already
    appended), register blocks that became full (`mark_computed`, batch order), and return the rows whose
    finish rules must run (those `FinishRules.rows_to_check` returns)."""
    stop_ids, eos_stops, cap, max_model_len = rule
    bm = sched.block_manager
    register = bm.enable_prefix_caching
    bs, done, mark = bm.block_size, bm._num_hashed.get, bm.mark_computed
    rows: list[int] = []
    for i, (q, t) in enumerate(zip(seqs, tokens)):
        outs = q.output_token_ids
        outs[-1] = t
        if register and q.num_computed_tokens // bs > done(q.seq_id, -1):
            mark(q)   # raises for a sequence without blocks
        n_out = len(outs)
        if (t in stop_ids or (eos_stops and t in q.eos_token_ids) or n_out >= cap
                or len(q.prompt_token_ids) + n_out >= max_model_len
                or q.detokenizer is not None or q.grammar is not None):
            rows.append(i)
    return rows


def _apply_rows(sched: Scheduler, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                launched: bool) -> list[Sequence]:
    ids, tokens, logprobs, spec = (runner_out.seq_ids, runner_out.token_ids, runner_out.logprobs,
                                   runner_out.spec_token_ids)
    rows: dict[int, int] | None = None   # seq_id -> row; built only when rows are not in batch order
    k = 0                                # the row expected next (rows come in batch order)
    mark_computed, check = sched.block_manager.mark_computed, sched.finish_rules.check
    finished: list[Sequence] = []
    # Requests that only a text rule (stop string, grammar) ended release their blocks after the rest of
    # the step, the others at once. The release order decides which blocks later requests get and which
    # cached prefixes are evicted first; this is the order of the engine before the rules were merged
    # here, so block tables and prefix-cache hits (num_cached_tokens) stay exactly as they were.
    text_finished: list[tuple[Sequence, str]] = []
    for s in out.scheduled:
        seq = s.seq
        if seq.status is _FINISHED:     # finished from outside between schedule() and update()
            continue
        if not launched:
            sched._advance(s)
        j = None
        if s.sample:
            sid = seq.seq_id
            if k < len(ids) and ids[k] == sid:
                j = k
            else:
                rows = rows if rows is not None else {x: i for i, x in enumerate(ids)}
                j = rows.get(sid)
                if j is None:
                    raise RuntimeError(f"model runner returned no token for sampled seq {sid}")
            k = j + 1
            if spec and sid in spec:
                apply_verdict(sched, seq, commit_verified(sched, s, runner_out), finished, text_finished)
                continue
            outs = seq.output_token_ids
            if launched:
                if not outs or outs[-1] != PENDING_TOKEN:
                    raise RuntimeError(f"seq {sid}: no pending token to resolve")
                outs[-1] = tokens[j]
            else:
                outs.append(tokens[j])
        # The token is resolved first: a launched step's successor may already count it as computed, and
        # registering a full block hashes its tokens. A sequence preempted since launch holds no blocks.
        if seq.status is _RUNNING:
            mark_computed(seq)
        if j is None:
            continue
        lp = logprobs[j] if j < len(logprobs) else None
        if lp is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(lp)
        verdict = check(seq)
        if verdict is not None:
            apply_verdict(sched, seq, verdict, finished, text_finished)
    for seq, reason in text_finished:
        sched.finish(seq, reason)
        finished.append(seq)
    return finished


def apply_verdict(sched: Scheduler, seq: Sequence, verdict: Finish | None, finished: list[Sequence],
                  text_finished: list[tuple[Sequence, str]]) -> None:
    """A token-rule verdict finishes `seq` now; a text-only one after the rest of the step."""
    if verdict is None:
        return
    if verdict.by_token_rule:
        sched.finish(seq, verdict.reason)
        finished.append(seq)
    else:
        text_finished.append((seq, verdict.reason))


def commit_verified(sched: Scheduler, s: ScheduledSequence, runner_out: ModelRunnerOutput) -> Finish | None:
    """An MTP verify step (engine/spec_decode/): append the step's tokens one by one, applying the finish
    rules after each exactly as one-token steps would, and stop at the first that finishes the request.
    Positions of rejected drafts (and of tokens after a finishing one) are not computed: their KV slots
    stay allocated and are overwritten when those positions are computed, and a block is only ever
    hashed from committed tokens."""
    seq = s.seq
    tokens = runner_out.spec_token_ids[seq.seq_id]
    lps = runner_out.spec_logprobs[seq.seq_id] if runner_out.spec_logprobs else [None] * len(tokens)
    seq.num_computed_tokens -= len(s.draft_token_ids) + 1 - len(tokens)
    verdict = None
    for token, lp in zip(tokens, lps, strict=True):
        seq.output_token_ids.append(token)
        if lp is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(lp)
        verdict = sched.finish_rules.check(seq)
        if verdict is not None:
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            break
    sched.block_manager.mark_computed(seq)
    return verdict
