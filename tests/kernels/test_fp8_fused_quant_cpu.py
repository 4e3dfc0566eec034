"""The fused FP8 activation quantization's references on CPU, and its interpreted kernels in the session's
TRITON_INTERPRET=1 process (tests/support/interpreted.py: test_fp8_fused_quant_interpreted.py)."""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.fp8_fused_quant import (
    quantize_rows_ref,
    rms_norm_quant_ref,
    silu_and_mul_quant_ref,
)
from deepinfer.kernels.reference.fp8_matmul import quantize_act_ref

from tests.support.interpreted import launches, run_interpreted


def test_references_are_the_unfused_compositions():
    from deepinfer.kernels.reference.activation import silu_and_mul_ref
    from deepinfer.kernels.reference.rmsnorm import rms_norm_ref

    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen)
    w = torch.rand(40, generator=gen) + 0.5
    q, s = quantize_rows_ref(x)
    assert s.shape == (5, 1) and torch.equal(s, quantize_act_ref(x, 40)[1])
    # One K-group spanning the row: the scale is the row max over 448, the row max maps onto +-448.
    assert torch.equal(s[:, 0], x.abs().amax(1) / 448.0)
    assert torch.equal(q.float().abs().amax(1), torch.full((5,), 448.0))
    out, summed = rms_norm_ref(x, w, 1e-6, r)
    qn, sn, res = rms_norm_quant_ref(x, w, 1e-6, r)
    assert torch.equal(res, summed) and torch.equal(sn, quantize_rows_ref(out)[1])
    qa, sa = silu_and_mul_quant_ref(torch.cat([x, r], 1))
    assert torch.equal(qa.view(torch.uint8), quantize_rows_ref(silu_and_mul_ref(torch.cat([x, r], 1)))[0]
                       .view(torch.uint8))


@launches("tests/kernels/test_fp8_fused_quant_interpreted.py")
def test_fused_quant_kernels_pass_under_interpreter(request):
    run_interpreted(request, "row quantizer and fused RMSNorm / SiLU-and-mul -> FP8")
