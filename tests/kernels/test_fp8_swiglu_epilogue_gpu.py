"""GPU (Hopper): the rowwise FP8 GEMM's SWIGLU epilogue over a gate_up weight whose rows alternate gate j,
up j gives, bit for bit, kernels/activation.silu_and_mul of the plain GEMM over the [gate | up] weight —
pointer and TMA loads, the decode and prefill tiles, ragged shapes, bf16 output — and with the planner
every row keeps its bits at M = 1, 7, 64, 256, 2048 on the Llama-3.1-8B gate_up shape."""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up, quantize_fp8_channel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


@pytest.fixture(scope="module")
def fr():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper-class GPU")
    from deepinfer.kernels import fp8_rowwise

    return fp8_rowwise


def _cfg(bm: int, bn: int, warps: int, stages: int, **extra: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "IMPRECISE_ACC": 0, **extra}


def _operands(m: int, i: int, k: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(2 * i, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_fp8_channel(w)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    return x, q, s.contiguous()


@pytest.mark.parametrize("m,i,k,cfg", [
    (256, 14336, 4096, _cfg(64, 128, 4, 4, TMA=1)),
    (2048, 14336, 4096, _cfg(128, 256, 8, 3, TMA=1, PERSISTENT=1)),
    (37, 1000, 4160, _cfg(128, 128, 8, 4, TMA=1)),       # ragged M and I, K % 128 == 64
    (300, 4864, 896, _cfg(64, 64, 4, 6)),                 # the 0.5B shape, pointer loads
])
def test_swiglu_epilogue_is_the_gemm_then_silu_and_mul_bitwise(fr, m, i, k, cfg):
    from deepinfer.kernels.activation import silu_and_mul

    x, w, s = _operands(m, i, k, seed=m + i)
    xq, xs = fr.quantize_rows(x)
    want = silu_and_mul(fr.rowwise_matmul(xq, xs, w, s, None, torch.bfloat16, cfg))
    wi, si = interleave_gate_up(w, s)
    for loads in (cfg, {key: v for key, v in cfg.items() if key not in ("TMA", "PERSISTENT")}):
        got = fr.rowwise_matmul(xq, xs, wi, si, None, torch.bfloat16, loads, swiglu=True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), loads


def test_swiglu_linear_rows_are_batch_invariant_with_the_planner(fr):
    x, w, s = _operands(2048, 14336, 4096, seed=3)
    wi, si = interleave_gate_up(w, s)
    planner = fr.RowwisePlanner()
    xq, xs = fr.quantize_rows(x)
    full = fr.fp8_rowwise_swiglu_quantized(xq, xs, wi, si, out_dtype=torch.bfloat16, planner=planner)
    assert all(planner.verdicts().values())
    for rows in (1, 7, 64, 256):
        part = fr.fp8_rowwise_swiglu_quantized(xq[:rows], xs[:rows], wi, si, out_dtype=torch.bfloat16,
                                               planner=planner)
        assert torch.equal(part.view(torch.int16), full[:rows].view(torch.int16)), rows
