"""One engine step on the device in two launches, so the overlapped loop (core/overlap.py) can put host work
between them: `forward` (the model over the scheduled tokens; a CUDA graph for pure-decode steps) and
`sample` (logits of the rows still alive -> token ids). Neither waits for the device, except the logprobs of
requests that ask for them; `SampledTokens.resolve` is the one small device -> host read of a step.

The synchronous step (`execute`) is the same two launches with the read right after them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence
from deepinfer.engine.runner.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from deepinfer.engine.sample.metadata import SamplingMetadata, index_tensor

if TYPE_CHECKING:
    from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
    from deepinfer.engine.runner.model_runner import ModelRunner
    from deepinfer.engine.runner.prefill_graphs import PrefillGraphs
    from deepinfer.engine.structured.manager import StepMasks


@dataclass
class SampledTokens:
    """The token ids one step sampled: on the device at once, on the host after `resolve`."""

    seq_ids: list[int]                 # row i was sampled for sequence seq_ids[i]
    device_ids: torch.Tensor           # int64 [S] on the device: the next step reads its inputs here
    logprobs: list[dict[int, float] | None]   # per row (already on the host), None where not requested
    host_ids: torch.Tensor | None      # pinned int64 [S] the ids are being copied into (CUDA); None on CPU
    ready: torch.cuda.Event | None     # recorded after that copy
    seqs: list[Sequence] | None = None   # the sequences of seq_ids, when known (do not modify the list)

    def row_of(self) -> dict[int, int]:
        """seq_id -> row in device_ids."""
        return {sid: i for i, sid in enumerate(self.seq_ids)}

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the ids (only this step's copy, not later work) and hand them to the scheduler."""
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host_ids if self.host_ids is not None else self.device_ids
        return ModelRunnerOutput(seq_ids=list(self.seq_ids), token_ids=ids.tolist(), logprobs=self.logprobs,
                                 seqs=self.seqs)


@dataclass
class ForwardPass:
    """A launched forward: the final hidden state of each sampling row of the step."""

    out: SchedulerOutput
    # [S, hidden], row i = out.sampled[i]; empty when nothing samples. May be a graph's static output, valid
    # until the next forward is launched (the stream orders that after this step's sampling).
    hidden: torch.Tensor


def pending_inputs(out: SchedulerOutput, prev: SampledTokens | None) -> list[tuple[int, int]]:
    """(flat token index, row in prev.device_ids) of every input token that is a placeholder.

    Only a sequence's last token can be pending (update resolves a step's tokens before the next is
    sampled), so at most one per scheduled sequence, and only when this step's range covers it."""
    prev_ids = prev.seq_ids if prev is not None else []
    rows: dict[int, int] | None = None      # built only when the batch order changed since prev
    found: list[tuple[int, int]] = []
    offset = 0
    for s in out.scheduled:
        seq = s.seq
        outs = seq.output_token_ids
        if outs and outs[-1] == PENDING_TOKEN:
            last = len(seq.prompt_token_ids) + len(outs) - 1
            if s.start <= last < s.start + s.num_new_tokens:
                # Steady decoding: the k-th pending input is the k-th row the previous step sampled.
                k = len(found)
                if k < len(prev_ids) and prev_ids[k] == seq.seq_id:
                    j: int | None = k
                else:
                    rows = rows if rows is not None else (prev.row_of() if prev is not None else {})
                    j = rows.get(seq.seq_id)
                if j is None:
                    raise RuntimeError(f"seq {seq.seq_id}: pending input but no step in flight sampled it")
                found.append((offset + last - s.start, j))
        offset += s.num_new_tokens
    return found


def copy_pending(ids: torch.Tensor, pending: SequenceABC[tuple[int, int]], prev_ids: torch.Tensor) -> None:
    """ids[dst] = prev_ids[src] for each (dst, src) of `pending` (`pending_inputs`), on the device, without
    blocking the host."""
    dst, src = zip(*pending)
    ids.index_copy_(0, index_tensor(dst, ids.device), prev_ids.index_select(0, index_tensor(src, ids.device)))


def _no_prompt_logprobs(out: SchedulerOutput) -> bool:
    """Whether no row of `out` reports a prompt logprob: those need every position's hidden state, which
    only the eager forward keeps (the cheap test first: most steps hold no such request)."""
    return all(s.seq.prompt_logprobs is None for s in out.scheduled) or not prompt_logprob_rows(out)


class StepExecutor:
    """Runs steps on a ModelRunner's model, cache and sampler; `graphs` (CUDA) serves pure-decode steps."""

    def __init__(self, runner: ModelRunner, graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None) -> None:
        self.runner = runner
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs   # prefill and mixed steps (runner/prefill_graphs.py)
        self.eager_steps = 0
        self.graph_steps = 0

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, prev: SampledTokens | None = None) -> ForwardPass:
        """Launch the model over `out`; placeholder inputs are read from `prev` on the device."""
        r = self.runner
        prev_ids = prev.device_ids if prev is not None else None
        d = out.decode
        if d is not None and self.graphs is not None and self.graphs.fits(out):
            # A decode batch (scheduler_decode.py): each row's input is its last token. No prompt positions.
            tokens = [q.output_token_ids[-1] for q in d.seqs]
            n_pending = tokens.count(PENDING_TOKEN)
            if n_pending == 0:
                pending: list[tuple[int, int]] | None = []
            elif n_pending == len(tokens) and prev is not None and (
                    (prev.seqs is not None and prev.seqs == d.seqs)   # the same rows: no id pass
                    or prev.seq_ids == [q.seq_id for q in d.seqs]):
                pending = None   # steady decoding: row i reads row i of the previous step
            else:
                pending = pending_inputs(out, prev)
            self.graph_steps += 1
            return ForwardPass(out, self.graphs.run(out, pending, prev_ids, tokens))
        pending = pending_inputs(out, prev)
        if self.graphs is not None and self.graphs.fits(out) and _no_prompt_logprobs(out):
            self.graph_steps += 1
            return ForwardPass(out, self.graphs.run(out, pending, prev_ids))
        pg = self.prefill_graphs
        if pg is not None and pg.fits(out) and _no_prompt_logprobs(out):
            hidden = pg.run(out, pending, prev_ids)
            if hidden is not None:
                return ForwardPass(out, hidden)
        prompt_rows = prompt_logprob_rows(out)
        self.eager_steps += 1
        batch = r.prepare(out)
        ids = batch.input_ids
        if pending:
            copy_pending(ids, pending, prev_ids)
        hidden = r.model(ids, batch.positions, batch.meta, r.kv_caches)
        record_prompt_logprobs(r.model, hidden, out, prompt_rows, r.vocab_size)
        return ForwardPass(out, hidden[batch.sample_indices])

    @torch.inference_mode()
    def sample(self, fwd: ForwardPass, seqs: list[Sequence], masks: StepMasks | None = None,
               masks_started: bool = False) -> SampledTokens:
        """Launch sampling for `seqs`, a subset of fwd.out's sampling sequences in batch order (the overlapped
        loop drops those found finished since the forward was launched). Masks are started here unless the
        caller started them (`masks_started`) while the forward ran."""
        r = self.runner
        if not seqs:
            return SampledTokens([], torch.empty(0, dtype=torch.int64, device=r.device), [], None, None, [])
        hidden = fwd.hidden
        sampled = fwd.out.sampled_seqs()
        if len(seqs) != len(sampled):
            row = {q.seq_id: i for i, q in enumerate(sampled)}
            hidden = hidden.index_select(0, index_tensor([row[s.seq_id] for s in seqs], r.device))
        if not masks_started and r.structured is not None:
            masks = r.structured.masks_for(seqs)
        # Logits in the model's dtype where the model offers them (engine/models/stack.py): the mask and the
        # sampler take bf16 and upcast exactly, so the same ids come out without a float32 copy of the logits.
        native = getattr(r.model, "compute_logits_native", None)
        logits = native(hidden) if native is not None else r.model.compute_logits(hidden)
        if logits.shape[-1] > r.vocab_size:
            logits = logits[:, : r.vocab_size]
        if masks is not None:
            masks.apply(logits)
        meta = SamplingMetadata.from_sequences(seqs, logits.shape[-1], r.device)
        result = r.sampler(logits, meta)
        ids = result.token_ids
        host, ready = None, None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return SampledTokens([s.seq_id for s in seqs], ids, result.logprobs, host, ready, seqs)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The synchronous step: forward and sample every sampling sequence, then read the ids."""
        seqs = out.sampled_seqs()
        r = self.runner
        # Grammar masks are filled on CPU threads while the device runs the forward pass.
        masks = r.structured.masks_for(seqs) if r.structured is not None and seqs else None
        fwd = self.forward(out)
        return self.sample(fwd, seqs, masks, masks_started=True).resolve()

    def stats(self) -> dict[str, float | int | list[int]]:
        """Step counters and the graphs' capture cost."""
        g = self.graphs.stats if self.graphs is not None else None
        return {
            "eager_steps": self.eager_steps,
            "graph_steps": self.graph_steps,
            "cuda_graphs_enabled": g is not None,
            "cuda_graph_buckets": list(g.buckets) if g else [],
            "cuda_graph_split_buckets": list(g.split_buckets) if g else [],
            "cuda_graph_capture_s": g.capture_seconds if g else 0.0,
            "cuda_graph_memory_bytes": g.memory_bytes if g else 0,
            "cuda_graph_padded_rows": g.padded_rows if g else 0,
            **prefill_graph_stats(self.prefill_graphs),
        }


def prefill_graph_stats(pg: PrefillGraphs | None) -> dict[str, float | int | list[int] | bool]:
    """The prefill graphs' counters (zeros when they are off)."""
    s = pg.stats if pg is not None else None
    return {
        "prefill_graphs_enabled": pg is not None and not pg.failed,
        "prefill_graph_steps": s.replays if s else 0,
        "prefill_graph_buckets": list(s.buckets) if s else [],
        "prefill_graph_split_buckets": list(s.split_buckets) if s else [],
        "prefill_graph_capture_s": s.capture_seconds if s else 0.0,
        "prefill_graph_memory_bytes": s.memory_bytes if s else 0,
        "prefill_graph_padded_tokens": s.padded_rows if s else 0,
    }
