"""SwiGLU gate: silu(x[:, :I]) * x[:, I:], with Hugging Face's roundings (elementwise, so batch-invariant).

HF computes act_fn(gate) in the input dtype (silu evaluated in fp32, rounded) and then multiplies by `up`
in the input dtype (product rounded once). The kernel performs the same two roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n_cols,
    stride_x, stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] -> silu(x[:, :I]) * x[:, I:] as [M, I] in x's dtype."""
    check_tensor("x", x, ndim=2)
    m, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: last dimension {two_i} must be even (gate and up halves)")
    i = two_i // 2
    out = torch.empty((m, i), dtype=x.dtype, device=x.device)
    if m > 0 and i > 0:
        _silu_and_mul_kernel[(m, triton.cdiv(i, _BLOCK))](
            x, out, i, x.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4,
        )
    return out
