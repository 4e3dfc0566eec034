"""Continuous-batching scheduler: token budget, chunked prefill, prefix caching, preemption by recompute.

One engine step is ``out = schedule()`` -> model runner -> ``update(out, runner_out)``; `update`
(core/scheduler_update.py) finishes requests by the finish rules (core/finish.py). The overlapped loop
(core/overlap.py) calls ``commit_launch(out)`` at launch, before the step's tokens are known.

Priority is FCFS: sequences are ordered by ``(seq.arrival, seq.seq_id)`` (lower first); `add()` must be
called in that order. Each step:
  1. running sequences, highest priority first, get their next tokens: 1 for a decode, the next chunk
     for one still in (chunked) prefill. When the KV cache cannot hold them, the lowest-priority running
     sequence is preempted by recompute (blocks freed, progress reset, back to the FRONT of the
     waiting queue, its output tokens kept) until it fits, or the sequence preempts itself when it is
     the lowest-priority one left.
  2. unless something was preempted this step, waiting sequences are admitted FCFS while the token
     budget, max_num_seqs and free blocks allow; admission reuses prefix-cached blocks.
A prefill that does not fit the remaining token budget is chunked (enable_chunked_prefill), its end
rounded down to a block boundary when the chunk still holds at least one block. Chunk sizes never
change numerics: attention reduces KV in chunks aligned to absolute positions.

Nothing depends on time, randomness or dict order: the same calls give the same schedule.
"""

from __future__ import annotations

import bisect
from collections import deque

from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.config import CacheConfig, SchedulerConfig
from deepinfer.engine.core.finish import FinishRules, token_finish_reason
from deepinfer.engine.core.scheduler_decode import schedule_decodes
from deepinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from deepinfer.engine.core.scheduler_update import apply_step
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus


def _priority(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival, seq.seq_id)


class Scheduler:
    """Decides which tokens of which sequences each forward pass computes."""

    def __init__(
        self,
        sched_cfg: SchedulerConfig,
        cache_cfg: CacheConfig,
        block_manager: BlockManager | None = None,
        finish_rules: FinishRules | None = None,
    ) -> None:
        """block_manager: built from cache_cfg when None. finish_rules: token rules plus stop strings
        when None (no grammar: requests have no grammar state without a structured-output handle)."""
        if cache_cfg.num_blocks is None:
            raise ValueError("Scheduler needs CacheConfig.num_blocks resolved (got None)")
        if block_manager is None:
            block_manager = BlockManager(
                cache_cfg.num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching
            )
        bm_shape = (block_manager.num_blocks, block_manager.block_size)
        if bm_shape != (cache_cfg.num_blocks, cache_cfg.block_size):
            raise ValueError(
                f"block manager ({block_manager.num_blocks} blocks of {block_manager.block_size}) does not "
                f"match CacheConfig ({cache_cfg.num_blocks} blocks of {cache_cfg.block_size})"
            )
        self.cfg = sched_cfg
        self.cache_cfg = cache_cfg
        self.block_manager = block_manager
        self.block_size = cache_cfg.block_size
        self.finish_rules = finish_rules if finish_rules is not None else FinishRules(sched_cfg.max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # kept sorted by _priority
        self._ids: set[int] = set()           # ids of unfinished sequences, to reject duplicates
        self._last_priority: tuple[int, int] | None = None
        # A plain BlockManager's append_slots only grows the table, so a decode whose slot lies in a block
        # the sequence already holds needs no call to it (_schedule_running). Subclasses (window_blocks.py
        # releases blocks on append) always take the full path.
        self._append_in_place = type(block_manager) is BlockManager

    # ---- requests ------------------------------------------------------------------------------
    def max_kv_tokens(self, seq: Sequence) -> int:
        """KV slots `seq` needs at most: every token but the last sampled one is computed."""
        return self._kv_slots(seq.num_prompt_tokens, seq.params.max_tokens)

    def _kv_slots(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        out_cap = self.cfg.max_model_len - num_prompt_tokens
        if max_tokens is not None:
            out_cap = min(out_cap, max_tokens)
        return num_prompt_tokens + out_cap - 1

    def refusal(self, num_prompt_tokens: int, max_tokens: int | None) -> str | None:
        """Why a request of this prompt length and output cap can never run here (None when it can): an
        empty prompt, a prompt not shorter than max_model_len, or more KV than the whole cache holds
        (prompt + output cap - 1 tokens). Callers that validate requests before queueing them ask this."""
        p = num_prompt_tokens
        if p == 0:
            return "the prompt is empty; give at least one token"
        if p >= self.cfg.max_model_len:
            return (f"prompt of {p} tokens leaves no room for output under max_model_len="
                    f"{self.cfg.max_model_len}; shorten the prompt or raise max_model_len")
        need = self._kv_slots(p, max_tokens)
        capacity = self.block_manager.token_capacity()
        if need > capacity:
            return (f"prompt of {p} tokens + up to {need + 1 - p} output tokens needs {need} KV slots but "
                    f"the cache holds {capacity} ({self.block_manager.num_blocks} blocks of "
                    f"{self.block_size}); lower max_tokens or max_model_len, or give the KV cache more "
                    "memory")
        return None

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError when it can never run (`refusal`)."""
        if seq.seq_id in self._ids:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if seq.status != SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} must be new (WAITING, nothing computed, no blocks)")
        problem = self.refusal(seq.num_prompt_tokens, seq.params.max_tokens)
        if problem is not None:
            raise ValueError(f"seq {seq.seq_id}: {problem}")
        prio = _priority(seq)
        if self._last_priority is not None and prio < self._last_priority:
            raise ValueError(
                f"seq {seq.seq_id}: (arrival, seq_id)={prio} added after {self._last_priority}; "
                "add requests in FCFS order"
            )
        self._last_priority = prio
        self._ids.add(seq.seq_id)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` now (by `update`, or from outside: abort): frees its blocks. No-op when it is
        already finished."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        # generate() keeps every request's Sequence until it returns: drop the penalty table now (tens of
        # KB a request) so a long call does not hold one per finished request.
        seq.penalty_tokens = None
        self._ids.discard(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens of `seq` to compute from `start` under `budget`: all that is left when it fits, else
        (chunked prefill) as many as fit, the end rounded down to a block boundary when that still leaves
        at least a block (the tokens given up go to later sequences); 0 = none."""
        remaining = seq.num_tokens - start
        if remaining <= budget:
            return remaining
        if not self.cfg.enable_chunked_prefill:
            return 0
        aligned = (start + budget) // self.block_size * self.block_size - start
        return aligned if aligned >= self.block_size else budget

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.preempt(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        victim.draft_token_ids = []
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        mml = self.cfg.max_model_len
        slots_per_block = self.block_size
        in_place = self._append_in_place
        scheduled = out.scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            outs = seq.output_token_ids
            n_out = len(outs)
            num_tokens = len(seq.prompt_token_ids) + n_out
            if n_out and outs[-1] == PENDING_TOKEN:
                max_tokens = seq.params.max_tokens
                # Overlapped loop: its in-flight token is its last whatever its value (max_tokens or
                # max_model_len), so another step would be computed only to be thrown away. (The length
                # test first, cheaply; the finish rules then decide as they do for a resolved token.)
                if ((max_tokens is not None and n_out >= max_tokens) or num_tokens >= mml) and \
                        token_finish_reason(seq, mml) == "length":
                    i += 1
                    continue
            start = seq.num_computed_tokens
            if (in_place and num_tokens - start == 1 and not seq.draft_token_ids
                    and start < len(seq.block_table) * slots_per_block):
                # A decode whose slot is in a block it already holds: nothing to allocate or preempt for,
                # exactly what the general path below does for it.
                scheduled.append(ScheduledSequence(seq, start, 1, True))
                budget -= 1
                i += 1
                continue
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            drafts = self._take_drafts(seq, n, budget)
            while not bm.can_append(seq, n):
                # The lowest-priority sequence is at the tail and not yet scheduled this step.
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.append_slots(seq, n + len(drafts))
            start = seq.num_computed_tokens
            out.scheduled.append(ScheduledSequence(seq, start, n + len(drafts), start + n == seq.num_tokens,
                                                   drafts))
            budget -= n + len(drafts)
            i += 1
        return budget

    def _take_drafts(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The MTP drafts (engine/spec_decode/) `seq` verifies this step: only in a decode (n == 1), cut to
        the token budget, and dropped when their slots would not fit without preempting. Consumed either
        way."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if not drafts or n != 1 or seq.num_uncomputed_tokens != 1:
            return []
        drafts = drafts[:budget - 1]
        if drafts and not self.block_manager.can_append(seq, 1 + len(drafts)):
            return []
        return drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if self._awaits_leader(seq):
                break   # FCFS: the sibling keeps its place; its leader's prefill ends within a step or two
            cached = self._cached_blocks(seq)
            start = len(cached) * self.block_size
            n = self._chunk(seq, start, budget)
            if n == 0 or not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, n, cached)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_priority)
            out.scheduled.append(ScheduledSequence(seq, start, n, start + n == seq.num_tokens))
            budget -= n
            if start + n < seq.num_tokens:
                break   # a chunked prefill takes the rest of this step's budget
        return budget

    def _cached_blocks(self, seq: Sequence) -> list[int]:
        # A cached position is never computed, so a request reporting prompt logprobs computes them all.
        return self.block_manager.match_prefix(seq) if seq.prompt_logprobs is None else []

    def admission_tokens(self, seq: Sequence) -> int:
        """Tokens the waiting `seq` would compute, all chunks together, if admitted now: those after its
        cached prefix. Between now and its admission the cache can only lose blocks within a step (the
        step's running sequences may evict, nothing registers), so this never exceeds what admission
        will count."""
        return seq.num_tokens - len(self._cached_blocks(seq)) * self.block_size

    def _awaits_leader(self, seq: Sequence) -> bool:
        """True while `seq` (sample i > 0 of a request) would miss prompt blocks that its leader (sample 0)
        is still computing: admitted now, it would compute the same prompt again in the same step; a step
        later it takes them from the prefix cache. Never waits on a leader that is not running."""
        leader = seq.leader
        if leader is None or leader.status != SequenceStatus.RUNNING:
            return False
        if not self.block_manager.enable_prefix_caching:
            return False
        shareable = (seq.num_prompt_tokens - 1) // self.block_size   # match_prefix's cap for a new sequence
        return self.block_manager.num_registered_blocks(leader) < shareable

    def schedule(self) -> SchedulerOutput:
        """Build the next step. Sequences appear at most once; never more than max_num_seqs of them and
        never more than max_num_batched_tokens tokens. Empty when nothing can run. A step of every running
        sequence decoding in place comes from the fast path (core/scheduler_decode.py), in columns."""
        out = schedule_decodes(self)
        if out is not None:
            return out
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:   # blocks freed by preemption belong to older sequences: admitting would thrash
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget
        return out

    def commit_launch(self, out: SchedulerOutput) -> None:
        """Overlapped loop: count the step's tokens as computed as soon as it is launched, so the next
        schedule, built before this step's results are read, continues after them. `update(out, ...,
        launched=True)` then applies the rest."""
        d = out.decode
        if d is not None:
            for seq, start in zip(d.seqs, d.starts):
                if seq.num_computed_tokens != start:
                    self._advance(ScheduledSequence(seq, start, 1, True))   # raises
                seq.num_computed_tokens = start + 1
            return
        for s in out.scheduled:   # _advance, inlined: this runs once per running sequence per step
            seq = s.seq
            if seq.num_computed_tokens != s.start:
                self._advance(s)   # raises
            seq.num_computed_tokens = s.start + s.num_new_tokens

    def _advance(self, s: ScheduledSequence) -> None:
        seq = s.seq
        if seq.num_computed_tokens != s.start:
            raise RuntimeError(
                f"seq {seq.seq_id}: step started at {s.start} but {seq.num_computed_tokens} are computed"
            )
        seq.num_computed_tokens = s.start + s.num_new_tokens

    def update(self, out: SchedulerOutput, runner_out: ModelRunnerOutput,
               launched: bool = False) -> list[Sequence]:
        """Apply a finished step: advance computed tokens, register full blocks for prefix caching,
        append sampled tokens (+ logprobs) and finish sequences by the finish rules. Returns the sequences
        finished by this step: those a token rule ended, then those only a text rule ended, each group
        in batch order (core/scheduler_update.py).

        launched=True (overlapped loop): `commit_launch(out)` already advanced the computed tokens, the
        next step may already have been scheduled (and have preempted some of these sequences), and each
        sampled sequence holds a PENDING_TOKEN that the real token replaces."""
        return apply_step(self, out, runner_out, launched)
