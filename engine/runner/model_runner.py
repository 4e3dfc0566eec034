"""Runs one scheduled step: flatten the batch, forward the model over the paged cache, sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.window_blocks import with_aux_tables
from deepinfer.engine.runner.host_step import flatten_step
from deepinfer.engine.sample.metadata import to_device
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
        step = flatten_step(out, self.block_size)
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(a), dev)

        positions = to_dev(step.positions)
        meta = AttentionMetadata(
            slot_mapping=to_dev(step.slot_mapping),
            positions=positions,
            query_start_loc=to_dev(step.query_start_loc()),
            seq_lens=to_dev(np.asarray(step.seq_lens, dtype=np.int32)),
            block_tables=to_dev(step.block_tables),
            block_size=self.block_size,
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
            query_lens_cpu=step.query_lens,
            seq_lens_cpu=step.seq_lens,
        )
        # A bounded-window cache's second pool (core/window_blocks.py): its tables travel with the metadata.
        meta = with_aux_tables(meta, [s.seq for s in out.scheduled], to_dev)
        return PreparedBatch(
            input_ids=to_dev(step.input_ids),
            positions=positions,
            meta=meta,
            sample_indices=to_dev(np.asarray(step.sample_rows, dtype=np.int64)),
        )

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens and sample one token per sequence that samples this step.

        The engine steps through runner/step_executor.py (forward and sample as separate launches, for the
        overlapped loop and CUDA graphs); this is its synchronous step, without graphs."""
        from deepinfer.engine.runner.step_executor import StepExecutor

        return StepExecutor(self).execute(out)
