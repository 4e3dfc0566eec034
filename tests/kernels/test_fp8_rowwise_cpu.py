"""Rowwise FP8 reference on CPU, and the interpreted rowwise / lagged-K-loop / FP8 MoE kernels in the
session's TRITON_INTERPRET=1 process (tests/support/interpreted.py: test_fp8_rowwise_interpreted.py and
test_fp8_moe_interpreted.py)."""

from __future__ import annotations

import pytest
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


def test_interleave_gate_up_alternates_gate_and_up_rows_with_their_scales():
    from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up

    w = torch.arange(6 * 4, dtype=torch.float32).view(6, 4).to(torch.float8_e4m3fn)
    s = torch.arange(6, dtype=torch.float32).view(6, 1)
    wi, si = interleave_gate_up(w, s)
    order = [0, 3, 1, 4, 2, 5]          # gate 0, up 0, gate 1, up 1, ...
    assert torch.equal(wi.view(torch.uint8), w.view(torch.uint8)[order])
    assert torch.equal(si, s[order])


@pytest.mark.parametrize("rows,scale_rows", [(5, 5), (6, 5)])
def test_interleave_gate_up_rejects_an_odd_or_mismatched_weight(rows, scale_rows):
    from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up

    w = torch.zeros(rows, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="expected \\[2I, K\\] and \\[2I, 1\\]"):
        interleave_gate_up(w, torch.ones(scale_rows, 1))
