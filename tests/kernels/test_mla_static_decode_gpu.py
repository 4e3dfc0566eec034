"""GPU: the MLA kernel's static decode plan (CUDA-graph decode steps) at DeepSeek shapes: the host plan's bits
for rows of 1 to 4 KV splits and the padding rows of a bucket; and one captured launch sequence replayed over
new positions (other split counts per row) giving, each time, the host plan's bits for those positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.kernels.reference.mla_decode import mla_decode_ref
from deepinfer.kernels.split_plan import split_counts

from tests.support.paged_batches import padded_decode_metadata, random_block_lists, same_bits

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
RANK, ROPE, BLOCK = 512, 64, 16
# bf16 tiles are 32 positions: under DETERMINISTIC_SPLITS 40 and 511 take one split, 512 and 700 two, 1100
# three, 1600 and 3000 four.
POSITIONS = [40, 511, 512, 1100, 1600, 3000, 700]


@pytest.fixture(scope="module")
def mk():
    from deepinfer.kernels import mla_decode

    return mla_decode


def _policy(mk, name):
    return {"deterministic": mk.DETERMINISTIC_SPLITS, "fast_form": mk.SplitPolicy(min_tiles=4, max_splits=16),
            "none": mk.NO_SPLIT}[name]


def _cache(max_pos: int, count: int, dtype: torch.dtype, seed: int):
    """Block lists and a cache holding `count` sequences of max_pos + 1 positions (NaN elsewhere, a finite
    block 0: what padding rows read)."""
    gen = torch.Generator().manual_seed(seed)
    blocks, num_blocks = random_block_lists([max_pos + 1] * count, BLOCK, seed=seed)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"), dtype=dtype, device=CUDA)
    cache[0] = torch.randn(BLOCK, RANK + ROPE, generator=gen).to(dtype)
    for bl in blocks:
        flat = torch.tensor([bl[i // BLOCK] * BLOCK + i % BLOCK for i in range(max_pos + 1)])
        cache.view(-1, RANK + ROPE)[flat.to(CUDA)] = torch.randn(max_pos + 1, RANK + ROPE,
                                                                 generator=gen).to(dtype).to(CUDA)
    return blocks, cache


def _q(rows: int, heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, RANK + ROPE, generator=gen) * 0.05).to(dtype).to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("policy", ["deterministic", "fast_form", "none"])
@pytest.mark.parametrize("heads", [16, 128, 5])
def test_static_decode_plan_gives_the_host_plans_bits(mk, heads, policy, dtype):
    pol = _policy(mk, policy)
    blocks, cache = _cache(max(POSITIONS), len(POSITIONS), dtype, seed=heads)
    if policy == "deterministic" and dtype == torch.bfloat16:
        assert set(split_counts(np.array(POSITIONS), 32, pol.min_tiles, pol.max_splits).tolist()) == \
            {1, 2, 3, 4}
    n, bucket = len(POSITIONS), 16                     # 9 padding rows
    q = _q(bucket, heads, dtype, seed=1)
    eager, graph = padded_decode_metadata(blocks, POSITIONS, bucket, BLOCK, CUDA)
    host = mk.mla_decode(q, cache, eager, 0.07, RANK, policy=pol)
    static = mk.mla_decode(q, cache, graph, 0.07, RANK, policy=pol)
    assert same_bits(static, host)
    alone, _ = padded_decode_metadata(blocks, POSITIONS, n, BLOCK, CUDA)
    assert same_bits(static[:n], mk.mla_decode(q[:n].contiguous(), cache, alone, 0.07, RANK, policy=pol))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    ref = mla_decode_ref(q, cache, eager, 0.07, RANK)
    torch.testing.assert_close(static.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("policy", ["deterministic", "fast_form"])
def test_captured_static_decode_replays_new_positions_with_the_host_plans_bits(mk, policy):
    """Captured once on static buffers, replayed after each step's rows are loaded into them: rows move
    between 1 and 4 splits, real rows become padding and back; the output is the host plan's every time."""
    from deepinfer.engine.runner.input_buffers import (
        DecodeRow,
        StaticDecodeBuffers,
        graph_metadata,
        pad_decode,
    )

    pol, heads, bucket, dtype = _policy(mk, policy), 16, 8, torch.bfloat16
    blocks, cache = _cache(3000, bucket, dtype, seed=7)
    steps = [[40, 600, 1100, 1600, 3000], [3000, 1600, 1100, 600, 40, 511, 512, 2000], [512], [40, 2999, 7]]
    width = max(len(b) for b in blocks)
    buf = StaticDecodeBuffers(bucket, width, CUDA)
    q_buf = torch.zeros(bucket, heads, RANK + ROPE, dtype=dtype, device=CUDA)

    def load(positions, seed):
        buf.load(pad_decode([DecodeRow(0, p, blocks[i]) for i, p in enumerate(positions)], bucket, BLOCK))
        q_buf.copy_(_q(bucket, heads, dtype, seed))

    load(steps[0], 0)
    meta = graph_metadata(buf, bucket, BLOCK)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mk.mla_decode(q_buf, cache, meta, 0.07, RANK, policy=pol)   # warm-up: compiles outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.mla_decode(q_buf, cache, meta, 0.07, RANK, policy=pol)
    for i, positions in enumerate(steps):
        load(positions, i)
        graph.replay()
        eager, _ = padded_decode_metadata([blocks[j] for j in range(len(positions))], positions, bucket,
                                          BLOCK, CUDA)
        host = mk.mla_decode(q_buf, cache, eager, 0.07, RANK, policy=pol)
        assert same_bits(out, host), f"replay {i}: {positions}"
