"""GPU (H200, bf16): the batch-invariant GEMM at the Qwen2.5-0.5B layer shapes (hidden 896), with the configs
MatmulPlanner picks for them (kernels/matmul.py): every M bucket's config agrees bitwise on these shapes, and
a row's bits are the same at M = 1, 7, 64, 256 (the decode graph buckets that matter), across the bucket
boundaries, wherever the row sits in the batch, and against the single-config kernel; the fixed-order
split-K path (MatmulConfig.split_k) is bitwise invariant across M on its own.
"""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.kernels.reference.matmul import bi_linear_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
SHAPES_05B = [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False),
              (151936, 896, False)]   # qkv (bias), o, gate_up, down, lm head (tied)


@pytest.fixture(scope="module")
def mm():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import matmul

    return matmul


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(BF16)


@pytest.mark.parametrize("n,k,bias", SHAPES_05B)
def test_05b_planner_configs_agree_and_rows_are_bitwise_invariant_across_m(mm, n, k, bias):
    planner = mm.MatmulPlanner()
    x = _randn(300, k, seed=1)
    w = _randn(n, k, seed=2, scale=k ** -0.5)
    b = _randn(n, seed=3) if bias else None
    full = mm.bi_linear(x, w, b, planner=planner)
    assert all(planner.verdicts().values()), planner.verdicts()   # the decode buckets are in use
    assert torch.equal(full, mm.bi_linear(x, w, b))
    for m in (1, 7, 64, 65, 128, 129, 256, 257):
        for start in (0, 3, 300 - m):
            part = mm.bi_linear(x[start:start + m].clone(), w, b, planner=planner)
            assert torch.equal(part, full[start:start + m]), f"M={m} rows {start}.."


@pytest.mark.parametrize("n,k,bias", SHAPES_05B[:4])
def test_05b_decode_bucket_configs_match_the_reference(mm, n, k, bias):
    planner = mm.MatmulPlanner()
    x = _randn(256, k, seed=4)
    w = _randn(n, k, seed=5, scale=k ** -0.5)
    b = _randn(n, seed=6) if bias else None
    got = mm.bi_linear(x, w, b, planner=planner).float()
    torch.testing.assert_close(got, bi_linear_ref(x, w, b).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,k,bias,split", [(896, 4864, False, 4), (1152, 896, True, 2),
                                            (896, 4864, False, 8)])
def test_fixed_order_split_k_rows_are_bitwise_invariant_across_m(mm, n, k, bias, split):
    cfg = mm.MatmulConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=split)
    x = _randn(300, k, seed=7)
    w = _randn(n, k, seed=8, scale=k ** -0.5)
    b = _randn(n, seed=9) if bias else None
    full = mm.bi_linear(x, w, b, config=cfg)
    torch.testing.assert_close(full.float(), bi_linear_ref(x, w, b).float(), atol=2e-2, rtol=2e-2)
    for m in (1, 7, 64, 256):
        for start in (0, 3, 300 - m):
            part = mm.bi_linear(x[start:start + m].clone(), w, b, config=cfg)
            assert torch.equal(part, full[start:start + m]), f"M={m} rows {start}.."


def test_05b_down_projection_partials_summed_in_the_norm_give_the_reduced_bits(mm):
    """The 0.5B down projection at decode sizes (a parallel split-K in the planner's buckets) handed to the
    next RMSNorm unsummed (bi_linear(defer_sum=True)): the norm's output and new residual stream are those
    of the reduced GEMM output through the plain norm, bit for bit, at every M and wherever a row sits."""
    from deepinfer.kernels.matmul_split import SplitSum
    from deepinfer.kernels.rmsnorm import rms_norm

    planner = mm.MatmulPlanner()
    n, k = 896, 4864
    x = _randn(300, k, seed=10)
    w = _randn(n, k, seed=11, scale=k ** -0.5)
    resid = _randn(300, n, seed=12)
    nw = _randn(n, seed=13)
    full_out, full_res = rms_norm(mm.bi_linear(x, w, planner=planner), nw, 1e-6, resid)
    for m in (1, 7, 64, 256):
        for start in (0, 3, 300 - m):
            rows = slice(start, start + m)
            part = mm.bi_linear(x[rows].clone(), w, planner=planner, defer_sum=True)
            assert isinstance(part, SplitSum), f"M={m}: no parallel split in this bucket"
            out, res = rms_norm(part, nw, 1e-6, resid[rows].clone())
            same = torch.equal(out, full_out[rows]) and torch.equal(res, full_res[rows])
            assert same, f"M={m} rows {start}.."
