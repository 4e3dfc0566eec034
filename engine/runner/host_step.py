"""A scheduled step flattened into host arrays: what the eager forward copies to the device and what a
prefill graph pads into its static buffers (runner/prefill_inputs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from deepinfer.engine.core.scheduler_output import SchedulerOutput


@dataclass
class HostStep:
    """B scheduled sequences, T new tokens in all, sequence-major (the order of `out.scheduled`)."""

    input_ids: np.ndarray      # int64 [T]; PENDING_TOKEN where the input is still on the device
    positions: np.ndarray      # int64 [T]: absolute position of each new token
    slot_mapping: np.ndarray   # int64 [T]: cache slot (block * block_size + offset) of each new token
    query_lens: list[int]      # [B]: new tokens of each sequence
    seq_lens: list[int]        # [B]: context length of each sequence after this step
    block_tables: np.ndarray   # int32 [B, max_blocks]: each sequence's blocks, padded with 0
    sample_rows: list[int]     # rows of the hidden states whose logits are sampled, batch order

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def query_start_loc(self) -> np.ndarray:
        return query_start_loc(self.query_lens)


def query_start_loc(query_lens: list[int]) -> np.ndarray:
    """int32 [B + 1]: the new tokens of sequence b are [qsl[b], qsl[b + 1])."""
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    return qsl


def flatten_step(out: SchedulerOutput, block_size: int) -> HostStep:
    """The host arrays of step `out` (an MTP verify step's draft tokens follow each sequence's own)."""
    bs = block_size
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
        k = len(s.draft_token_ids)
        ids.append(np.asarray(s.seq.tokens_range(s.start, end - k) + s.draft_token_ids, dtype=np.int64))
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        offset += s.num_new_tokens
        if s.sample:
            sample_rows.extend(range(offset - 1 - k, offset))   # a verify step samples every position
    return HostStep(np.concatenate(ids), np.concatenate(pos), np.concatenate(slots), query_lens, seq_lens,
                    tables, sample_rows)
