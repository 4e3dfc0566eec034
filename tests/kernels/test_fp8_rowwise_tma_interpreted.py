"""Rowwise FP8 GEMM with TMA tile loads (kernels/fp8_rowwise_tma.py) and the rowwise M-bucket planner under
Triton's interpreter (a subprocess with TRITON_INTERPRET=1, started by
tests/kernels/test_bucket_planner_cpu.py), tiny shapes: the TMA kernel (launched directly: on CPU
`rowwise_matmul` falls back to pointer loads) gives the pointer kernel's bits for ragged M / N, a K tail,
bias and the persistent loop, and matches the reference; the planner proves its tiny buckets on real
outputs and keeps rows bitwise invariant across M. The SWIGLU epilogue over a gate_up weight whose rows
alternate gate j, up j gives, bit for bit, kernels/activation.silu_and_mul of the plain GEMM over the
[gate | up] weight (both loaders, three output dtypes), with the planner too."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up
from deepinfer.kernels.reference.fp8_matmul import fp8_rowwise_linear_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_bucket_planner_cpu.py")


@pytest.fixture(scope="module")
def rw():
    mod = interpreted_kernels("fp8_rowwise", "_rowwise_gemm_kernel")
    interpreted_kernels("fp8_rowwise_tma", "_rowwise_tma_kernel")
    interpreted_kernels("activation", "_silu_and_mul_kernel")
    return mod


def _cfg(bm: int, bn: int, bk: int = 32, **extra: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 2, "num_warps": 4, "num_stages": 2,
            "IMPRECISE_ACC": 0, **extra}


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(n, 1, generator=gen) * 1e-3 + 1e-4
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0                       # an all-zero row (scale EPS / 448)
    bias = torch.randn(n, generator=gen)
    return x, w, s, bias


@pytest.mark.parametrize("m,n,k,cfg", [
    (37, 40, 80, _cfg(16, 16)),                      # ragged M and N, K % BLOCK_K != 0
    (5, 16, 64, _cfg(16, 16, PERSISTENT=1)),         # fewer rows than a tile
    (70, 33, 48, _cfg(32, 16, PERSISTENT=1)),        # the persistent loop: 3 programs over 9 tiles
    (70, 33, 48, _cfg(32, 16, PERSISTENT=1, FLATTEN=1)),   # the same loop flattened into the K loop
    (20, 48, 128, _cfg(16, 32, 64)),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tma_kernel_matches_pointer_kernel_bitwise(rw, m, n, k, cfg, with_bias):
    from deepinfer.kernels.fp8_rowwise_tma import rowwise_tma_launch

    x, w, s, bias = _operands(m, n, k, seed=m + n + k)
    b = bias if with_bias else None
    xq, xs = rw.quantize_rows(x)
    pointer = rw.rowwise_matmul(xq, xs, w, s, b, torch.float32, cfg)
    tma = rowwise_tma_launch(xq, xs, w, s, b, torch.empty(m, n), {**cfg, "TMA": 1})
    assert torch.equal(tma, pointer)
    torch.testing.assert_close(tma, fp8_rowwise_linear_ref(x, w, s, b), rtol=1e-5, atol=1e-5)


def test_tma_config_falls_back_to_pointer_loads_where_tma_cannot_read(rw):
    x, w, s, _ = _operands(9, 16, 40, seed=3)           # K = 40: rows are not 16-byte multiples
    xq, xs = rw.quantize_rows(x)
    cfg = _cfg(16, 16)
    assert torch.equal(rw.rowwise_matmul(xq, xs, w, s, None, torch.float32, {**cfg, "TMA": 1}),
                       rw.rowwise_matmul(xq, xs, w, s, None, torch.float32, cfg))


def test_planner_proves_tiny_buckets_and_rows_stay_bitwise_across_m(rw, monkeypatch):
    # The buckets differ in what cannot change bits on any device (stages, the persistent loop): the
    # interpreter's dot is numpy's, whose per-element sums may depend on the tile shape, so other tile
    # shapes are the GPU test's matter (tests/kernels/test_fp8_rowwise_tma_gpu.py).
    small, large = _cfg(16, 16, TMA=1), {**_cfg(16, 16, TMA=1, PERSISTENT=1), "num_stages": 3}
    monkeypatch.setattr(rw, "rowwise_buckets", lambda n, k: ((16, small), (None, large)))
    x, w, s, bias = _operands(50, 40, 96, seed=11)
    planner = rw.RowwisePlanner()
    full = rw.fp8_rowwise_linear(x, w, s, bias, planner=planner)
    assert planner.verdicts() == {"40x96 float32 cpu": True}
    assert planner.config(*rw.quantize_rows(x[:16]), w, s, bias, torch.float32) == small
    assert planner.config(*rw.quantize_rows(x), w, s, bias, torch.float32) == large
    for rows in (1, 7, 16, 17):       # rows in the other bucket: the same bits
        assert torch.equal(rw.fp8_rowwise_linear(x[:rows], w, s, bias, planner=planner), full[:rows])
    torch.testing.assert_close(full, fp8_rowwise_linear_ref(x, w, s, bias), rtol=1e-5, atol=1e-5)


def test_planner_falls_back_to_the_single_config_when_a_bucket_differs(rw, monkeypatch):
    # Another BLOCK_K in one bucket changes the fp32 chain: the proof must see real bits differ.
    small, other_k = _cfg(16, 16, 32), _cfg(16, 16, 64)
    monkeypatch.setattr(rw, "rowwise_buckets", lambda n, k: ((16, small), (None, other_k)))
    single = _cfg(16, 32, 32)
    monkeypatch.setattr(rw, "rowwise_tile_config", lambda m, n, k: single)
    x, w, s, _ = _operands(40, 24, 200, seed=5)
    xq, xs = rw.quantize_rows(x)
    assert not torch.equal(rw.rowwise_matmul(xq, xs, w, s, None, torch.float32, small),
                           rw.rowwise_matmul(xq, xs, w, s, None, torch.float32, other_k))
    planner = rw.RowwisePlanner()
    assert planner.config(xq, xs, w, s, None, torch.float32) == single
    assert planner.config(xq[:3], xs[:3], w, s, None, torch.float32) == single
    assert planner.verdicts() == {"24x200 float32 cpu": False}


def test_quantized_entry_takes_the_planner_too(rw, monkeypatch):
    small, large = _cfg(16, 16), {**_cfg(16, 16), "num_stages": 3}
    monkeypatch.setattr(rw, "rowwise_buckets", lambda n, k: ((16, small), (None, large)))
    x, w, s, _ = _operands(30, 16, 64, seed=8)
    xq, xs = rw.quantize_rows(x)
    planner = rw.RowwisePlanner()
    out = rw.fp8_rowwise_linear_quantized(xq, xs, w, s, out_dtype=torch.float32, planner=planner)
    assert torch.equal(out, rw.fp8_rowwise_linear(x, w, s, planner=planner))
    assert planner.verdicts() == {"16x64 float32 cpu": True}


def test_invariant_ops_backend_owns_a_planner_and_the_fast_one_none(rw):
    from deepinfer.engine.layers import cuda_ops
    from deepinfer.engine.layers.ops import QuantizedActivation

    ops, fast = cuda_ops.CudaInvariantOps(), cuda_ops.CudaFastOps()
    assert fast._fp8_planner is None and ops._fp8_planner is not cuda_ops.CudaInvariantOps()._fp8_planner
    x, w, s, bias = _operands(20, 32, 64, seed=2)
    out = ops.fp8_linear(x, w, s, bias, 64)
    # The proof ran on the first call (its verdict on the interpreter's numpy dot does not matter here):
    # either way the bits are the single config's.
    assert list(ops._fp8_planner.verdicts()) == ["32x64 float32 cpu"]
    assert torch.equal(out, rw.fp8_rowwise_linear(x, w, s, bias))
    rows = QuantizedActivation(*rw.quantize_rows(x), x.dtype)
    assert torch.equal(ops.fp8_linear(rows, w, s, bias, 64), out)


@pytest.mark.parametrize("m,n,k,group,k_loop,with_bias", [
    (37, 40, 80, 32, 0, True),        # ragged M and N, a K tail (K = 2.5 groups)
    (37, 40, 80, 32, 1, False),       # the lagged K loop
    (5, 16, 64, 16, 1, True),
    (20, 33, 48, 32, 0, False),
])
def test_block_tma_kernel_matches_pointer_kernel_bitwise(m, n, k, group, k_loop, with_bias):
    from deepinfer.kernels import fp8_matmul as fm
    from deepinfer.kernels.fp8_block_tma import block_tma_launch
    from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref

    interpreted_kernels("fp8_block_tma", "_block_tma_kernel")
    gen = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(n, -(-k // group), generator=gen) * 1e-3 + 1e-4
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen) if with_bias else None
    xq, xs = fm.quantize_act(x, group)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": group, "GROUP_M": 2, "num_warps": 4, "num_stages": 2,
           "K_LOOP": k_loop}
    pointer = fm.block_matmul(xq, xs, w, s, bias, torch.float32, cfg)
    tma = block_tma_launch(xq, xs, w, s, bias, torch.empty(m, n), {**cfg, "TMA": 1})
    assert torch.equal(tma, pointer)
    torch.testing.assert_close(tma, fp8_linear_ref(x, w, s, bias, group=group), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K_LOOP"):
        block_tma_launch(xq, xs, w, s, bias, torch.empty(m, n), {**cfg, "TMA": 1, "K_LOOP": 2})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("m,i,k,cfg", [
    (37, 20, 80, _cfg(16, 16)),                  # ragged M and I (the last tile half outside), K tail
    (5, 16, 64, _cfg(16, 32, PERSISTENT=1)),     # fewer rows than a tile
    (70, 24, 48, _cfg(32, 16, PERSISTENT=1)),    # the persistent loop over several tiles
    (70, 24, 48, _cfg(32, 16, PERSISTENT=1, FLATTEN=1)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_epilogue_is_the_gemm_then_silu_and_mul_bitwise(rw, m, i, k, cfg, dtype):
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_rowwise_tma import rowwise_tma_launch

    x, w, s, _ = _operands(m, 2 * i, k, seed=m + i + k)
    xq, xs = rw.quantize_rows(x)
    unfused = silu_and_mul(rw.rowwise_matmul(xq, xs, w, s, None, dtype, cfg))
    wi, si = interleave_gate_up(w, s)
    pointer = rw.rowwise_matmul(xq, xs, wi, si, None, dtype, cfg, swiglu=True)
    tma = rowwise_tma_launch(xq, xs, wi, si, None, torch.empty(m, i, dtype=dtype), {**cfg, "TMA": 1},
                             swiglu=True)
    assert pointer.shape == unfused.shape == (m, i)
    assert torch.equal(_bits(pointer), _bits(unfused))
    assert torch.equal(_bits(tma), _bits(unfused))


def test_swiglu_linear_with_the_planner_keeps_the_unfused_bits_across_m(rw, monkeypatch):
    from deepinfer.kernels.activation import silu_and_mul

    small, large = _cfg(16, 16, TMA=1), {**_cfg(16, 16, TMA=1, PERSISTENT=1), "num_stages": 3}
    monkeypatch.setattr(rw, "rowwise_buckets", lambda n, k: ((16, small), (None, large)))
    x, w, s, _ = _operands(40, 48, 96, seed=5)
    wi, si = interleave_gate_up(w, s)
    planner = rw.RowwisePlanner()
    xq, xs = rw.quantize_rows(x)
    full = rw.fp8_rowwise_swiglu_quantized(xq, xs, wi, si, out_dtype=torch.float32, planner=planner)
    # The reference takes its tiles from the same planner (the interpreter's dot is numpy's, whose sums may
    # depend on the tile shape: see the planner test above).
    plain = rw.fp8_rowwise_linear_quantized(xq, xs, w, s, out_dtype=torch.float32, planner=planner)
    assert torch.equal(full, silu_and_mul(plain))
    assert planner.verdicts() == {"48x96 float32 cpu": True}
    for rows in (1, 7, 16, 17):
        part = rw.fp8_rowwise_swiglu_quantized(xq[:rows], xs[:rows], wi, si, out_dtype=torch.float32,
                                               planner=planner)
        assert torch.equal(part, full[:rows])
