"""Rowwise FP8 reference on CPU, and the interpreted rowwise / lagged-K-loop / FP8 MoE kernels in the
session's TRITON_INTERPRET=1 process (tests/support/interpreted.py: test_fp8_rowwise_interpreted.py and
test_fp8_moe_interpreted.py)."""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref, fp8_rowwise_linear_ref

from tests.support.interpreted import launches, run_interpreted


def test_rowwise_reference_is_per_channel_dequantized_matmul():
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=gen) * 0.05
    x = torch.randn(5, 96, generator=gen)
    q, s = quantize_fp8_block(w, (1, 96))          # per output channel: scale [24, 1]
    assert s.shape == (24, 1)
    out = fp8_rowwise_linear_ref(x, q, s)
    assert torch.equal(out, fp8_linear_ref(x, q, s, group=96))
    dense = x @ w.T
    assert float((out - dense).abs().max()) < 0.1 * float(dense.abs().max())


@launches("tests/kernels/test_fp8_rowwise_interpreted.py", "tests/kernels/test_fp8_moe_interpreted.py")
def test_rowwise_and_moe_kernels_pass_under_interpreter(request):
    run_interpreted(request, "FP8 rowwise GEMM and FP8 MoE")
