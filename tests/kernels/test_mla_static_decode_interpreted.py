"""The MLA kernel's static decode plan (CUDA-graph decode steps) on CPU under Triton's interpreter: the same
bits as the host-planned launches, for rows of 1 to 4 KV splits and the padding rows of a graph bucket.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_mla_decode_cpu.py starts one).
A decode step is padded as the engine pads it (engine/runner/input_buffers.py) and given to `mla_decode`
in its two forms (tests/support/paged_batches.py `padded_decode_metadata`): the eager form, whose true host
lengths the host plan reads, and the graph form, whose host lengths are placeholders and whose launches come
from `meta.decode_plan`. Every row, padding rows included, must come out bit for bit the same; the real rows
also equal an eager step of the real rows alone, and are close to the plain reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.kernels.reference.mla_decode import mla_decode_ref
from deepinfer.kernels.split_plan import split_counts, static_decode_ranges

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import padded_decode_metadata, random_block_lists, same_bits

skip_unless_interpreting("tests/kernels/test_mla_decode_cpu.py")

RANK, ROPE, BLOCK = 32, 8, 16


@pytest.fixture(scope="module")
def mla():
    return interpreted_kernels("mla_decode", "_mla_split_kernel")


def _policy(mla, name):
    return {"deterministic": mla.DETERMINISTIC_SPLITS, "none": mla.NO_SPLIT,
            "fast_form": mla.SplitPolicy(min_tiles=4, max_splits=16),   # fast_split_policy's form
            "three_splits": mla.SplitPolicy(min_tiles=2, max_splits=3)}[name]


def _decode_case(positions, heads, dtype, seed):
    """Random cache (NaN outside the rows' contexts, finite block 0: what padding rows read) and q_abs
    rows for a decode step of tokens at `positions`; returns (blocks, cache, q for every bucket row)."""
    gen = torch.Generator().manual_seed(seed)
    blocks, num_blocks = random_block_lists([p + 1 for p in positions], BLOCK, seed=seed)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"))
    cache[0] = torch.randn(BLOCK, RANK + ROPE, generator=gen)
    for bl, p in zip(blocks, positions):
        flat = torch.tensor([bl[i // BLOCK] * BLOCK + i % BLOCK for i in range(p + 1)])
        cache.view(-1, RANK + ROPE)[flat] = torch.randn(p + 1, RANK + ROPE, generator=gen)
    q = torch.randn(16, heads, RANK + ROPE, generator=gen)
    return blocks, cache.to(dtype), q.to(dtype)


def _both_forms(mla, positions, bucket, heads, dtype, policy, seed=0):
    blocks, cache, q = _decode_case(positions, heads, dtype, seed)
    eager, graph = padded_decode_metadata(blocks, positions, bucket, BLOCK)
    assert graph.seq_lens_cpu == [1] * bucket and graph.decode_plan is not None   # placeholders
    qs = q[:bucket].contiguous()
    host = mla.mla_decode(qs, cache, eager, 0.2, RANK, policy=policy)
    static = mla.mla_decode(qs, cache, graph, 0.2, RANK, policy=policy)
    return host, static, (blocks, cache, qs, eager)


# fp32 (BLOCK_N 16). Each policy's positions span its split counts, the rest of a bucket is padding:
# deterministic: 3 and 255 one split, 256 two, 520 and 600 three, 800 and 1100 four; fast_form: 10 one,
# 70 two, 200 four, 600 ten; three_splits: 5 one, 40 two, 100 and 300 three. Twenty heads: two head
# blocks, one partial.
@pytest.mark.parametrize("policy,heads,positions,bucket,splits", [
    ("deterministic", 4, [3, 255, 256, 520, 800, 1100], 8, {1, 2, 3, 4}),
    ("deterministic", 20, [600], 1, {3}),
    ("fast_form", 4, [10, 70, 200, 600], 8, {1, 2, 4, 10}),
    ("fast_form", 20, [200, 10], 4, {1, 4}),
    ("three_splits", 20, [5, 40, 100, 300], 4, {1, 2, 3}),
    ("none", 4, [3, 800], 4, {1}),
])
def test_static_decode_plan_gives_the_host_plans_bits(mla, policy, heads, positions, bucket, splits):
    pol = _policy(mla, policy)
    assert set(split_counts(np.array(positions), 16, pol.min_tiles, pol.max_splits).tolist()) == splits
    host, static, (blocks, cache, qs, eager) = _both_forms(mla, positions, bucket, heads, torch.float32, pol)
    assert same_bits(static, host), "static decode plan differs from the host plan"
    assert not static.isnan().any()
    n = len(positions)
    alone, _ = padded_decode_metadata(blocks, positions, n, BLOCK)    # an eager step of the real rows
    assert same_bits(static[:n], mla.mla_decode(qs[:n].contiguous(), cache, alone, 0.2, RANK, policy=pol))
    torch.testing.assert_close(static, mla_decode_ref(qs, cache, eager, 0.2, RANK), atol=3e-5, rtol=3e-5)


def test_static_decode_plan_cut_into_launches_keeps_the_bits(mla, monkeypatch):
    """A scratch budget of two tokens' partials cuts the static plan into four launches of the 8 rows."""
    pol = _policy(mla, "three_splits")
    positions = [300, 5, 100, 40, 300, 100, 5]
    host, static, _ = _both_forms(mla, positions, 8, 4, torch.float32, pol, seed=3)
    slot_bytes = 4 * (RANK + 2) * 4
    from deepinfer.kernels import split_combine
    monkeypatch.setattr(split_combine, "SCRATCH_BUDGET_BYTES", 2 * pol.max_splits * slot_bytes)
    assert static_decode_ranges(8, pol.max_splits, slot_bytes, split_combine.SCRATCH_BUDGET_BYTES) == \
        [(0, 2), (2, 4), (4, 6), (6, 8)]
    _, cut, _ = _both_forms(mla, positions, 8, 4, torch.float32, pol, seed=3)
    assert same_bits(cut, static) and same_bits(cut, host)


def test_bf16_static_decode_plan_at_the_deterministic_split_thresholds(mla, monkeypatch):
    """bf16 (BLOCK_N 32, the GPU's tile): positions 511 / 512 / 1100 / 1600 take 1 / 2 / 3 / 4 splits."""
    gpu_like_bf16(monkeypatch)
    pol = mla.DETERMINISTIC_SPLITS
    positions = [511, 512, 1100, 1600, 40]
    assert split_counts(np.array(positions), 32, pol.min_tiles, pol.max_splits).tolist() == \
        [1, 2, 3, 4, 1]
    host, static, _ = _both_forms(mla, positions, 8, 16, torch.bfloat16, pol, seed=5)
    assert static.dtype == torch.bfloat16 and same_bits(static, host)


def test_static_decode_plan_rejects_a_plan_of_another_size(mla):
    blocks, cache, q = _decode_case([5, 9], 4, torch.float32, 0)
    _, graph = padded_decode_metadata(blocks, [5, 9], 2, BLOCK)
    graph.decode_plan = graph.decode_plan[:2]
    with pytest.raises(ValueError, match="decode_plan"):
        mla.mla_decode(q[:2].contiguous(), cache, graph, 0.2, RANK)
