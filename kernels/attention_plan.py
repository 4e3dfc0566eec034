"""The paged-attention kernel's program map (kernels/paged_attention.py), in numpy: no Triton here, so the
CPU engine's code that stages CUDA-graph steps (engine/runner/prefill_inputs.py) can build it too."""

from __future__ import annotations

import numpy as np


def build_plan(query_lens: list[int], seq_lens: list[int], block_q: int) -> np.ndarray:
    """Flattened (sequence, query block) pairs, int32 [2 * programs]: heaviest first (the longest KV range,
    i.e. the largest last position a block attends to) for load balance, ties by sequence then query block.
    Built once per step on the host, in array operations: a prefill step has thousands of blocks, and the
    Python loop this replaces took 1.5-1.9 ms of the H200 host's time per step (benchmarks/RESULTS.md)."""
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    if q.shape != s.shape:
        raise ValueError(f"query_lens ({q.size}) and seq_lens ({s.size}) differ in length")
    blocks = -(-q // block_q)
    seq = np.repeat(np.arange(q.size), blocks)
    qb = np.arange(seq.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    last = s[seq] - q[seq] + np.minimum((qb + 1) * block_q, q[seq])
    order = np.lexsort((qb, seq, -last))    # the last key sorts first
    return np.stack((seq[order], qb[order]), axis=1).reshape(-1).astype(np.int32)
