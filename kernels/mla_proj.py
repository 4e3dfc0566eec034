"""Per-head projection for MLA's absorbed form (Triton): out[t, h] = W[h] @ x[t, h], batch-invariant.

MLA multiplies each head's query by its own W_UK^T (into latent space) and each head's latent output by
its own W_UV; both are one batched GEMM over heads. Weights are strided views of kv_b_proj.weight (no
copies). As in kernels/matmul.py: every output element is accumulated in fp32 over K in BLOCK_K tiles in
increasing order by one `tl.dot` chain whose tile shape depends on (N, K, dtype) only, there is no split-K,
and rows beyond T are clamped to row 0 and never stored, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.gemm_parts import k_chain

__all__ = ["head_proj", "head_proj_config"]


def head_proj_config(n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config from the weight shape and dtype only (never the number of tokens)."""
    del n, k  # one config for every shape; kept so a shape-dependent policy stays T-free
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


@triton.jit(do_not_specialize=["T"])
def _head_proj_kernel(
    x_ptr, w_ptr, out_ptr, T, N, K,
    stride_xt, stride_xh, stride_wh, stride_wn, stride_wk, stride_ot, stride_oh,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < T, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + head * stride_xh + offs_k[None, :]
    w_ptrs = w_ptr + head * stride_wh + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # EVEN_K=False: every K tile is loaded masked, as this kernel always has.
    acc = k_chain(acc, x_ptrs, w_ptrs, offs_k, K, 0, tl.cdiv(K, BLOCK_K), 1, stride_wk, False, IEEE, BLOCK_K)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N))


def head_proj(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, K] (last dim contiguous), weight [H, N, K] (any strides) -> out [T, H, N] in x's dtype.

    `out` may be a strided view (e.g. the first N columns of a wider buffer) with a contiguous last dim.
    """
    check_tensor("x", x, ndim=3)
    check_tensor("weight", weight, ndim=3, device=x.device, last_dim_contiguous=False)
    check_same_dtype("weight", weight, x.dtype)
    t, h, k = x.shape
    if weight.shape[0] != h or weight.shape[2] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match x {tuple(x.shape)} "
                         f"(expected [{h}, N, {k}])")
    n = weight.shape[1]
    if out is None:
        out = torch.empty((t, h, n), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=3, device=x.device)
        check_same_dtype("out", out, x.dtype)
        if tuple(out.shape) != (t, h, n):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(t, h, n)}")
    if t == 0:
        return out
    cfg = head_proj_config(n, k, x.dtype)
    grid = (triton.cdiv(t, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), h)
    _head_proj_kernel[grid](
        x, weight, out, t, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        out.stride(0), out.stride(1),
        IEEE=x.dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
