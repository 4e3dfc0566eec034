"""The SWIGLU epilogue of the batch-invariant 16-bit GEMM (kernels/matmul.bi_linear's `swiglu`, both loaders)
on CPU under Triton's interpreter (started by test_bi_linear_swiglu_cpu.py), tiny shapes.

The claim the engine relies on (engine/layers/mlp.py): on a gate_up weight whose rows alternate gate j, up j,
the fused form equals, bit for bit, the plain GEMM over the [gate | up] weight followed by
kernels/activation.silu_and_mul, for every config (pointer and TMA loads, persistent or not, ragged shapes,
bias, the split-K and K = 0 fallbacks).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.models.quant.fp8_tensor import interleave_halves

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_bi_linear_swiglu_cpu.py")


@pytest.fixture(scope="module")
def mods():
    return {name: interpreted_kernels(name) for name in ("matmul", "matmul_tma", "activation")}


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _operands(m, i, k, bias, dtype):
    x = _rand(m, k, dtype=dtype, seed=1)
    w = (_rand(2 * i, k, seed=2) / k**0.5).to(dtype)
    b = _rand(2 * i, dtype=dtype, seed=3) if bias else None
    return x, w, b


# (m, I, k, bias, dtype, persistent, split_k): fp16 and float32 (the interpreter's bf16 tl.dot is not exact).
CASES = [
    (37, 24, 80, False, torch.float16, False, 1),   # ragged M, N tail inside a tile, K tail
    (70, 16, 64, True, torch.float16, True, 1),     # persistent loop over several tiles, bias
    (5, 40, 32, False, torch.float32, True, 1),     # fewer rows than a tile, IEEE dots
    (19, 32, 96, True, torch.float16, False, 3),    # split-K: the plain result, then the activation
]


@pytest.mark.parametrize("m,i,k,bias,dtype,persistent,split", CASES)
def test_swiglu_epilogue_equals_gemm_then_silu_and_mul(mods, m, i, k, bias, dtype, persistent, split):
    mm, act = mods["matmul"], mods["activation"]
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2,
                          persistent=persistent, split_k=split)
    x, w, b = _operands(m, i, k, bias, dtype)
    want = act.silu_and_mul(mm.bi_linear(x, w, b, config=cfg))
    wi = interleave_halves(w)
    bi = interleave_halves(b) if b is not None else None
    got = mm.bi_linear(x, wi, bi, config=cfg, swiglu=True)
    assert got.shape == (m, i) and got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("m,i,k,bias,persistent", [(37, 24, 80, True, False), (70, 16, 64, False, True)])
def test_tma_swiglu_epilogue_equals_the_pointer_kernels(mods, m, i, k, bias, persistent):
    # Launched directly: on CPU bi_linear never takes TMA loads (tma_usable needs a CUDA device).
    mm, tma = mods["matmul"], mods["matmul_tma"]
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2,
                          persistent=persistent)
    x, w, b = _operands(m, i, k, bias, torch.float16)
    wi, bi = interleave_halves(w), (interleave_halves(b) if b is not None else None)
    tiles = -(-m // 16) * -(-(2 * i) // 16)
    programs = min(tiles, 3) if persistent else tiles
    got = tma.tma_launch(x, wi, bi, torch.empty(m, i, dtype=x.dtype), 16, 16, 32, 2, 4, 2, programs,
                         swiglu=True)
    assert torch.equal(got, mm.bi_linear(x, wi, bi, config=cfg, swiglu=True))


def test_swiglu_epilogue_with_the_planner_and_k_zero(mods):
    mm, act = mods["matmul"], mods["activation"]
    x, w, _ = _operands(33, 24, 64, False, torch.float16)
    planner = mm.MatmulPlanner()
    want = act.silu_and_mul(mm.bi_linear(x, w, planner=planner))
    assert torch.equal(mm.bi_linear(x, interleave_halves(w), planner=planner, swiglu=True), want)
    empty_k = mm.bi_linear(torch.empty(4, 0, dtype=torch.float16), torch.empty(6, 0, dtype=torch.float16),
                           swiglu=True)
    assert torch.equal(empty_k, torch.zeros(4, 3, dtype=torch.float16))


def test_swiglu_needs_an_even_row_count(mods):
    with pytest.raises(ValueError, match="even count"):
        mods["matmul"].bi_linear(torch.ones(2, 8), torch.ones(5, 8), swiglu=True)
