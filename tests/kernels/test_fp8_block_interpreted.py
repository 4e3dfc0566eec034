"""The block-scaled FP8 path under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, started by
tests/kernels/test_fp8_block_cpu.py), tiny shapes.

Bitwise: the fused per-token-group quantization (kernels/fp8_group_quant.py) against the unfused kernels it
replaces (rmsnorm.rms_norm / activation.silu_and_mul, then fp8_matmul.quantize_act), rows independent of
the batch; the TMA block kernel with one weight scale per tile and the persistent loop against the pointer
kernel; BlockPlanner's proof on tiny buckets and the CUDA ops backend's block path (fused rows in, the
linear quantizing its own input, the same bits). Against the plain-torch references
(kernels/reference/fp8_fused_quant.py): the same scales and codes at most one e4m3 step apart.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fp8_fused_quant import (
    rms_norm_group_quant_ref,
    silu_and_mul_group_quant_ref,
)
from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref

from tests.kernels.interpreter_bf16 import float32_or_gpu_bf16
from tests.kernels.test_fp8_fused_quant_interpreted import _near, _same, _x
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fp8_block_cpu.py")


@pytest.fixture(scope="module")
def km():
    return {name: interpreted_kernels(name) for name in ("fp8_group_quant", "fp8_matmul", "rmsnorm",
                                                         "activation", "fp8_block_tma")}


dtype = float32_or_gpu_bf16   # the tests' `dtype` fixture: float32, and bfloat16 with the GPU's roundings


@pytest.mark.parametrize("h,group", [(1, 16), (48, 16), (100, 32), (256, 64), (300, 128), (64, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_group_quant_is_unfused_kernels_bitwise(km, dtype, h, group, with_residual):
    x = _x(6, h, seed=h, dtype=dtype)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(1))).to(dtype)
    r = _x(6, h, seed=h + 1, dtype=dtype).flip(0).contiguous() if with_residual else None
    q, s, res = km["fp8_group_quant"].rms_norm_group_quant(x, w, 1e-5, group, residual=r)
    if with_residual:
        out, summed = km["rmsnorm"].rms_norm(x, w, 1e-5, residual=r)
        assert torch.equal(res, summed)
    else:
        out = km["rmsnorm"].rms_norm(x, w, 1e-5)
        assert res is None
    assert s.shape == (6, -(-h // group))
    _same((q, s), km["fp8_matmul"].quantize_act(out, group))
    if dtype == torch.float32:
        q_ref, s_ref, res_ref = rms_norm_group_quant_ref(x, w, 1e-5, group, r)
        _near((q, s), (q_ref, s_ref))
        assert res_ref is None or torch.equal(res, res_ref)


def test_rms_norm_group_quant_wide_rows_and_bad_groups(km):
    gq = km["fp8_group_quant"]
    h = 2 * gq.FUSED_NORM_MAX + 8     # past the fused kernel's widest row: the unfused composition
    x, r = _x(2, h, seed=3), _x(2, h, seed=4)
    w = torch.rand(h, generator=torch.Generator().manual_seed(5)) + 0.5
    q, s, res = gq.rms_norm_group_quant(x, w, 1e-6, 128, residual=r)
    out, summed = km["rmsnorm"].rms_norm(x, w, 1e-6, residual=r)
    _same((q, s), km["fp8_matmul"].quantize_act(out, 128))
    assert torch.equal(res, summed)
    for bad in (48, 8):
        with pytest.raises(ValueError, match="power of two"):
            gq.rms_norm_group_quant(x[:, :64], w[:64], 1e-6, bad)
        with pytest.raises(ValueError, match="power of two"):
            gq.silu_and_mul_group_quant(x[:, :64], bad)


@pytest.mark.parametrize("m,i,group", [(1, 1, 16), (7, 36, 16), (20, 100, 32), (3, 257, 64), (17, 256, 128)])
def test_silu_and_mul_group_quant_is_unfused_kernels_bitwise(km, dtype, m, i, group):
    x = torch.cat([_x(m, i, seed=i, dtype=dtype), _x(m, i, seed=i + 9, dtype=dtype) * 0.1], dim=1)
    if m > 4:
        x[4, :i] = 60.0    # silu(60) = 60: a group max meets the e4m3 range edge through the product
    got = km["fp8_group_quant"].silu_and_mul_group_quant(x, group)
    _same(got, km["fp8_matmul"].quantize_act(km["activation"].silu_and_mul(x), group))
    if dtype == torch.float32:
        _near(got, silu_and_mul_group_quant_ref(x, group))
    with pytest.raises(ValueError, match="even"):
        km["fp8_group_quant"].silu_and_mul_group_quant(x[:, :-1].contiguous(), group)


def test_group_rows_do_not_depend_on_the_batch(km):
    gq = km["fp8_group_quant"]
    x, r = _x(40, 72, seed=11), _x(40, 72, seed=12)
    w = torch.rand(72, generator=torch.Generator().manual_seed(13)) + 0.5
    full = gq.rms_norm_group_quant(x, w, 1e-5, 16, residual=r)
    g = torch.cat([x, r], dim=1)
    full_act = gq.silu_and_mul_group_quant(g, 32)
    for lo, hi in ((0, 1), (17, 18), (3, 40)):   # one row takes 1-row programs, more take 16
        part = gq.rms_norm_group_quant(x[lo:hi].clone(), w, 1e-5, 16, residual=r[lo:hi].clone())
        _same(part[:2], (full[0][lo:hi], full[1][lo:hi]))
        _same(gq.silu_and_mul_group_quant(g[lo:hi].clone(), 32), (full_act[0][lo:hi], full_act[1][lo:hi]))


def _block_operands(m: int, n: int, k: int, group: int, scale_rows: int, seed: int):
    """x, an e4m3 weight and row scales equal within aligned blocks of `scale_rows` rows."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = torch.rand(-(-n // scale_rows), -(-k // group), generator=gen) * 1e-3 + 1e-4
    s = blocks.repeat_interleave(scale_rows, 0)[:n].contiguous()
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0
    return x, w, s, torch.randn(n, generator=gen)


@pytest.mark.parametrize("m,n,k,extra,scale_block_n", [
    (37, 64, 80, {}, 32),                          # one weight scale per 16-wide tile, ragged M, K tail
    (37, 40, 80, {}, 32),                          # ragged N: the last tile's first column still in range
    (70, 48, 64, {"PERSISTENT": 1}, 16),           # 3 programs over 15 tiles
    (20, 32, 96, {"PERSISTENT": 2, "K_LOOP": 1}, 32),
    (9, 48, 64, {}, 0),                            # per-column scales
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_tma_tile_scales_and_persistent_loop_give_pointer_bits(km, m, n, k, extra, scale_block_n,
                                                                     with_bias):
    fm = km["fp8_matmul"]
    group = 32
    x, w, s, bias = _block_operands(m, n, k, group, max(scale_block_n, 16), seed=m + n + k)
    b = bias if with_bias else None
    xq, xs = fm.quantize_act(x, group)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": group, "GROUP_M": 2, "num_warps": 4, "num_stages": 2,
           "K_LOOP": extra.get("K_LOOP", 0)}
    pointer = fm.block_matmul(xq, xs, w, s, b, torch.float32, cfg)
    tma = km["fp8_block_tma"].block_tma_launch(xq, xs, w, s, b, torch.empty(m, n),
                                               {**cfg, **extra, "TMA": 1}, scale_block_n)
    assert torch.equal(tma, pointer)
    torch.testing.assert_close(tma, fp8_linear_ref(x, w, s, b, group=group), rtol=1e-5, atol=1e-5)


def _tiny_table(monkeypatch, bp):
    # The reference's tile shape in both buckets: the interpreter's dot is numpy's, whose sums follow the
    # tile shape (on the GPU the sweep and the proof decide that); stages, loader and loop still differ.
    monkeypatch.setitem(bp.BLOCK_BUCKET_TABLE, "default",
                        ((16, "64x128x128 w4 s2 tma"), (None, "64x128x128 w4 s4 tma pers1")))


def test_block_planner_proves_tiny_buckets_and_rows_stay_invariant(km, monkeypatch):
    from deepinfer.kernels import fp8_block_plan as bp

    _tiny_table(monkeypatch, bp)
    x, w, s, bias = _block_operands(40, 32, 256, 128, 128, seed=3)
    planner = bp.BlockPlanner()
    full = bp.block_linear(x, w, s, bias, planner=planner, scale_block_n=128)
    assert planner.verdicts() == {"32x256 float32 cpu 128": True}
    xq, xs = km["fp8_matmul"].quantize_act(x, 128)
    assert torch.equal(full, km["fp8_matmul"].block_matmul(xq, xs, w, s, bias, torch.float32,
                                                           bp.parse_config(bp.REFERENCE)))
    for m in (1, 7, 16, 17):
        assert torch.equal(bp.block_linear(x[:m].clone(), w, s, bias, planner=planner, scale_block_n=128),
                           full[:m])
    rows = bp.block_linear_quantized(xq, xs, w, s, bias, out_dtype=torch.float32, planner=planner,
                                     scale_block_n=128)
    assert torch.equal(rows, full)
    # Another scale_block_n is another verdict (the proof exercises what the calls will run).
    bp.block_linear(x, w, s, bias, planner=planner)
    assert set(planner.verdicts()) == {"32x256 float32 cpu 128", "32x256 float32 cpu 0"}
    with pytest.raises(ValueError, match="one scale per token and K-group"):
        bp.block_linear_quantized(xq, xs[:, :1], w, s, out_dtype=torch.float32)


def test_block_planner_keeps_the_reference_where_a_bucket_disagrees(km, monkeypatch):
    from deepinfer.kernels import fp8_block_plan as bp

    # K loop 2 (two partial accumulators) sums in another order: not the reference's bits.
    monkeypatch.setitem(bp.BLOCK_BUCKET_TABLE, "default", ((None, "16x16x128 w4 s2"),))
    monkeypatch.setattr(bp, "parse_config", lambda name, _p=bp.parse_config: {**_p(name), "K_LOOP": 2}
                        if name == "16x16x128 w4 s2" else _p(name))
    x, w, s, _ = _block_operands(24, 32, 512, 128, 128, seed=4)
    planner = bp.BlockPlanner()
    out = bp.block_linear(x, w, s, planner=planner)
    assert planner.verdicts() == {"32x512 float32 cpu 0": False}
    assert torch.equal(out, bp.block_linear(x, w, s, planner=None))     # the reference config


def test_cuda_ops_block_path_fused_rows_and_own_quantization_agree(km, monkeypatch):
    from deepinfer.engine.layers import cuda_ops
    from deepinfer.engine.layers.ops import Ops
    from deepinfer.kernels import fp8_block_plan as bp

    _tiny_table(monkeypatch, bp)
    ops = cuda_ops.CudaInvariantOps()
    assert cuda_ops.CudaFastOps()._block_planner is None and ops._block_planner is not None
    x, w, s, bias = _block_operands(20, 32, 256, 128, 128, seed=5)
    want = ops.fp8_linear(x, w, s, bias, 128, scale_block_n=128)
    assert list(ops._block_planner.verdicts()) == ["32x256 float32 cpu 128"]
    rows = ops.quantize_groups(x, 128)
    assert rows.group == 128 and torch.equal(ops.fp8_linear(rows, w, s, bias, 128, scale_block_n=128), want)
    nw = torch.rand(256, generator=torch.Generator().manual_seed(6)) + 0.5
    fused, summed = ops.add_rms_norm_quant(x, x.flip(0).contiguous(), nw, 1e-5, 128)
    plain, plain_sum = Ops.add_rms_norm_quant(ops, x, x.flip(0).contiguous(), nw, 1e-5, 128)   # unfused
    assert torch.equal(summed, plain_sum)
    _same((fused.values, fused.scales), (plain.values, plain.scales))
    g = torch.cat([x, x * 0.5], dim=1)
    act = ops.silu_and_mul_quant(g, 128)
    _same((act.values, act.scales), km["fp8_matmul"].quantize_act(km["activation"].silu_and_mul(g), 128))
    with pytest.raises(ValueError, match="K-group of 128"):
        ops.fp8_linear(act, w, s, None, 64)       # the layer's K-group is not the rows' group
