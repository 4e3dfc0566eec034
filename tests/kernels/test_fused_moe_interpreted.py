"""kernels/fused_moe.py on CPU under Triton's interpreter, tiny shapes.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_fused_moe_cpu.py starts one).
Checks the expert-sorted layout, agreement with kernels/reference/fused_moe.py (experts with no, one and
several row blocks; top-k from 1 to 3; hidden and intermediate sizes that leave tile tails) and the
argument checks, in float32; in bfloat16 (interpreter patched to the GPU's bf16 dot and rounding,
tests/kernels/interpreter_bf16.py) that the kernel is at least as precise as transformers' bf16 expert loop.
Bitwise batch invariance is checked on the GPU (test_fused_moe_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fused_moe import fused_moe_ref
from deepinfer.kernels.reference.moe import combine_experts, experts_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fused_moe_cpu.py")


@pytest.fixture(scope="module")
def moe():
    return interpreted_kernels("fused_moe", "_gate_up_kernel")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _routing(num_tokens, experts, top_k, seed, skew=False):
    """Distinct sorted expert ids per token and positive weights; `skew` crowds most tokens on expert 1."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, experts, generator=gen)
    if skew:
        scores[: num_tokens * 3 // 4, 1] += 2.0
    ids = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return ids, weights


def test_align_sorts_stably_and_pads_each_expert_to_whole_blocks(moe):
    ids = torch.tensor([[0, 3], [1, 3], [3, 4], [0, 1], [3, 5]])
    sorted_ids, block_expert, row_of = moe.moe_align(ids, 6, 4)
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids >= 0].long()
    assert flat[real].tolist() == sorted(flat.tolist())                   # grouped by expert ...
    for e in range(6):                                                    # ... in assignment order
        mine = real[flat[real] == e].tolist()
        assert mine == sorted(mine)
    assert torch.equal(sorted_ids[row_of].long(), torch.arange(flat.numel()))
    blocks = block_expert.tolist()
    used = [b for b in blocks if b >= 0]
    assert used == [0, 1, 3, 4, 5] and blocks[len(used):] == [-1] * (len(blocks) - len(used))
    for b, e in enumerate(used):                                           # a block holds one expert
        rows = sorted_ids[4 * b:4 * b + 4]
        assert rows[0] >= 0 and (flat[rows[rows >= 0].long()] == e).all()


@pytest.mark.parametrize("t,h,inter,experts,top_k,skew", [
    (1, 64, 32, 4, 2, False),
    (23, 48, 40, 6, 3, True),       # tails in N and K; one expert spans two row blocks
    (9, 96, 24, 8, 1, False),
])
def test_fused_moe_matches_reference(moe, t, h, inter, experts, top_k, skew):
    x = _rand(t, h, seed=1)
    gate_up = _rand(experts, 2 * inter, h, seed=2) / h ** 0.5
    down = _rand(experts, h, inter, seed=3) / inter ** 0.5
    ids, weights = _routing(t, experts, top_k, seed=4, skew=skew)
    ref = fused_moe_ref(x, ids, weights, gate_up, down)
    for invariant in (True, False):        # fast mode: 16-row blocks for these small batches
        got = moe.fused_moe(x, ids, weights, gate_up, down, invariant=invariant)
        assert got.shape == (t, h) and not got.isnan().any()
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_bf16_fused_moe_is_as_precise_as_transformers_expert_loop(moe, monkeypatch):
    """bf16 in and out: each GEMM accumulates in fp32, silu(gate) * up is taken in fp32 and rounded once to
    bf16 (h), y rounds once per expert, and the combine sums fp32 weights times y in fp32: no further from
    the exact result than the engine's CPU path, which rounds gate, up, silu and each GEMM output to bf16 as
    transformers' expert loop does (and transformers also rounds each weighted term before adding it)."""
    gpu_like_bf16(monkeypatch)
    bf = torch.bfloat16
    t, h, inter, experts, top_k = 23, 64, 40, 6, 2
    x = _rand(t, h, seed=5).to(bf)
    gate_up = (_rand(experts, 2 * inter, h, seed=6) / h ** 0.5).to(bf)
    down = (_rand(experts, h, inter, seed=7) / inter ** 0.5).to(bf)
    ids, weights = _routing(t, experts, top_k, seed=8)
    exact = fused_moe_ref(x.float(), ids, weights, gate_up.float(), down.float())
    hf_like = (combine_experts(experts_ref(x, ids, gate_up, down), weights).float() - exact).abs()
    for invariant in (True, False):
        got = moe.fused_moe(x, ids, weights, gate_up, down, invariant=invariant)
        assert got.dtype == bf
        err = (got.float() - exact).abs()
        assert err.mean() <= hf_like.mean() and err.max() <= hf_like.max(), (err.max(), hf_like.max())


def test_tile_config_never_depends_on_the_batch(moe):
    for dtype in (torch.bfloat16, torch.float32):
        assert moe.moe_tile_config(2816, 2048, dtype) == moe.moe_tile_config(2816, 2048, dtype)
    assert "ids" not in moe.moe_tile_config.__code__.co_varnames


@pytest.mark.parametrize("change,match", [
    ({"ids": torch.zeros(3, 2)}, "ids: dtype"),
    ({"weights": torch.zeros(3, 3)}, "must both be"),
    ({"down": torch.zeros(4, 16, 7)}, "down: shape"),
    ({"gate_up": torch.zeros(4, 16, 12)}, "gate_up: shape"),
    ({"weights": torch.zeros(2, 3).T}, "contiguous"),
])
def test_fused_moe_rejects_bad_arguments(moe, change, match):
    args = {"x": torch.zeros(3, 16), "ids": torch.zeros(3, 2, dtype=torch.int64),
            "weights": torch.zeros(3, 2),
            "gate_up": torch.zeros(4, 16, 16), "down": torch.zeros(4, 16, 8)}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moe.fused_moe(**args)


@pytest.mark.parametrize(("rows", "cols", "stride_pad"), [
    (1, 1, 0), (3, 8, 0), (130, 64, 0), (257, 65, 3), (5, 160, 1),
])
def test_row_sum_in_order_gives_the_torch_loops_bits(rows, cols, stride_pad):
    """kernels/row_sum.py: one launch, the same left-to-right float32 adds as the routers' torch loop
    (`sum_last_in_order`), bit for bit, rows of any stride; a row's sum does not depend on the others."""
    from deepinfer.kernels.reference.moe import sum_last_in_order

    mod = interpreted_kernels("row_sum")
    # Values spanning many binades: a different summation order would show in the low bits.
    base = _rand(rows, cols + stride_pad, seed=rows + cols).exp() * 1e3
    x = base[:, :cols]
    out = mod.row_sum_in_order(x)
    assert torch.equal(out, sum_last_in_order(x))
    assert torch.equal(mod.row_sum_in_order(x[-1:].contiguous()), out[-1:])


@pytest.mark.parametrize(("x", "match"), [
    (torch.zeros(4, 8, dtype=torch.float64), "dtype"),
    (torch.zeros(4, 0), "at least one column"),
    (torch.zeros(8), "ndim|rank|dimension"),
])
def test_row_sum_in_order_rejects_bad_input(x, match):
    mod = interpreted_kernels("row_sum")
    with pytest.raises(ValueError, match=match):
        mod.row_sum_in_order(x)
