"""Runs one scheduled step: flatten the batch, forward the model over the paged cache, sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.window_blocks import with_aux_tables
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from deepinfer.engine.structured.lazy import LazyStructuredOutputs


@dataclass
class PreparedBatch:
    """The flattened, device-resident inputs of one forward pass."""

    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor   # int64 [S]: rows of the hidden states whose logits are sampled


class ModelRunner:
    """Owns the model, its KV cache and the sampler; `execute` is one engine step on the device.

    Host-side batch building uses numpy and copies to the device once per tensor (pinned, non-blocking).
    The engine drives it through runner/step_executor.py (overlapped loop, CUDA graphs of decode steps).
    """

    def __init__(self, model, kv_caches, block_size: int, vocab_size: int, device: torch.device,
                 structured: LazyStructuredOutputs | None = None) -> None:
        """structured: where the grammar masks of constrained requests come from (None: never masked)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.structured = structured

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        bs = self.block_size
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        offset = 0
        for b, s in enumerate(out.scheduled):
            end = s.start + s.num_new_tokens
            p = np.arange(s.start, end, dtype=np.int64)
            table = np.asarray(s.seq.block_table, dtype=np.int64)
            tables[b, : len(table)] = table
            # An MTP verify step's draft tokens follow the sequence's own (engine/spec_decode/).
            k = len(s.draft_token_ids)
            ids.append(np.asarray(s.seq.tokens_range(s.start, end - k) + s.draft_token_ids, dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            offset += s.num_new_tokens
            if s.sample:
                sample_rows.extend(range(offset - 1 - k, offset))   # a verify step samples every position
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t

        positions = to_dev(np.concatenate(pos))
        meta = AttentionMetadata(
            slot_mapping=to_dev(np.concatenate(slots)),
            positions=positions,
            query_start_loc=to_dev(qsl),
            seq_lens=to_dev(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to_dev(tables),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        # A bounded-window cache's second pool (core/window_blocks.py): its tables travel with the metadata.
        meta = with_aux_tables(meta, [s.seq for s in out.scheduled], to_dev)
        return PreparedBatch(
            input_ids=to_dev(np.concatenate(ids)),
            positions=positions,
            meta=meta,
            sample_indices=to_dev(np.asarray(sample_rows, dtype=np.int64)),
        )

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens and sample one token per sequence that samples this step.

        The engine steps through runner/step_executor.py (forward and sample as separate launches, for the
        overlapped loop and CUDA graphs); this is its synchronous step, without graphs."""
        from deepinfer.engine.runner.step_executor import StepExecutor

        return StepExecutor(self).execute(out)
