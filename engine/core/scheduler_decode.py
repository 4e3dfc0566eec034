"""The scheduler's decode fast path: a step in which every running sequence decodes one token.

In steady decoding every step is the same decision for every running sequence: compute its one uncomputed
token, taking a new block when that token starts one. `Scheduler.schedule` reaches it row by row; this
reaches it in one lean pass and describes the step in columns (scheduler_output.DecodeBatch) instead of
one ScheduledSequence per row. When any row needs anything else (drafts, a prefill chunk, a preemption for
lack of blocks, the overlapped loop's last-token rule), or a waiting request could be admitted, it returns
None having changed nothing, and the general path builds the step: the two paths never disagree on a step
they both build (tests/engine/test_scheduler_fast_paths.py).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import TYPE_CHECKING

from deepinfer.engine.core.scheduler_output import DecodeBatch, SchedulerOutput
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence

if TYPE_CHECKING:
    from deepinfer.engine.core.scheduler import Scheduler


def schedule_decodes(sched: Scheduler) -> SchedulerOutput | None:
    """The step `Scheduler.schedule` would build, when it is every running sequence decoding one token
    (taking a new block where its slot starts one, as the general path does, in batch order); else None,
    with nothing changed."""
    running = sched.running
    n = len(running)
    cfg = sched.cfg
    # A plain BlockManager only (scheduler._append_in_place); the budget holds every row; no admission.
    if not sched._append_in_place or n == 0 or n > cfg.max_num_batched_tokens or (
            sched.waiting and n < cfg.max_num_seqs):
        return None
    bs = sched.block_size
    starts: list[int] = []
    grow: list[Sequence] = []      # rows whose slot is the first of a block they do not hold yet
    pending = False
    for q in running:
        outs = q.output_token_ids
        st = q.num_computed_tokens
        if not outs or q.draft_token_ids or len(q.prompt_token_ids) + len(outs) - st != 1:
            return None   # still in prefill, or MTP drafts to verify
        held = len(q.block_table) * bs
        if st >= held:
            if st > held:
                return None
            grow.append(q)
        if outs[-1] == PENDING_TOKEN:
            pending = True
        starts.append(st)
    if pending and _may_end_by_length(running, cfg.max_model_len):
        # Overlapped loop: a sequence whose in-flight token may be its last by length is left to the
        # general path, which skips it when the finish rules say so.
        return None
    if grow:
        bm = sched.block_manager
        if len(grow) > bm.num_free_blocks:
            return None   # someone would be preempted
        for q in grow:   # one block each, in batch order: the blocks the general path would hand out
            bm.append_slots(q, 1)
    return SchedulerOutput(decode=DecodeBatch(list(running), starts), num_batched_tokens=n)


def _may_end_by_length(running: list[Sequence], max_model_len: int) -> bool:
    """Whether a sequence with a pending last token has reached max_tokens or max_model_len."""
    params = [q.params for q in running]
    p0 = params[0]
    if all(map(operator.is_, params, repeat(p0))):
        cap = p0.max_tokens
        for q in running:
            n_out = len(q.output_token_ids)
            if (cap is not None and n_out >= cap) or len(q.prompt_token_ids) + n_out >= max_model_len:
                if q.output_token_ids[-1] == PENDING_TOKEN:
                    return True
        return False
    for q in running:
        n_out = len(q.output_token_ids)
        cap = q.params.max_tokens
        if (cap is not None and n_out >= cap) or len(q.prompt_token_ids) + n_out >= max_model_len:
            if q.output_token_ids[-1] == PENDING_TOKEN:
                return True
    return False
