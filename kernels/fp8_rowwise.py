"""Rowwise-scaled FP8 GEMM: out = (x_q @ w_q^T) * s_x[:, None] * s_w[None, :], scales applied once.

For per-channel and per-tensor FP8 weights ("FP8-Dynamic" checkpoints, `quantization="fp8-channel"`):
`quantize_rows` (kernels/fp8_row_quant.py) turns activations x [M, K] into e4m3 with ONE float32 scale per
row (max |x| of the row / 448), or the op producing x already did (kernels/fp8_fused_quant.py:
`fp8_rowwise_linear_quantized` takes those rows); the weight is e4m3 [N, K] with one scale per output
channel [N, 1] (a per-tensor scale broadcast).
Since no scale varies along K, the K loop is a plain `acc = tl.dot(a, b, acc)` chain (the tensor-core
pipeline runs asynchronously, like torch._scaled_mm rowwise) and both scales multiply the fp32 accumulator
once in the epilogue. The math is `fp8_linear_ref` with a single K-group (kernels/reference/fp8_matmul.py).

Batch invariance (`invariant=True`): the row scale is row-local (its max is exact whatever the chunking),
the tile config is a function of (N, K) only, K is walked in increasing order with no split-K and rows past
M read row 0 and are never stored, so a row's bits depend on neither M nor the other rows. The fast mode
picks the tile from M too. `ROWWISE_CANDIDATES` are the tiles a sweep (benchmarks/bench_fp8.py --sweep)
compares on the device; `config=` runs any of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.fp8_matmul import grouped_tile
from deepinfer.kernels.fp8_row_quant import quantize_rows
from deepinfer.kernels.reference.fp8_matmul import FP8_DTYPE

__all__ = ["quantize_rows", "fp8_rowwise_linear", "fp8_rowwise_linear_quantized", "rowwise_tile_config",
           "ROWWISE_CANDIDATES"]


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, imprecise: int = 0) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "IMPRECISE_ACC": imprecise}


# Hopper candidates (smem per stage = (BLOCK_M + BLOCK_N) * BLOCK_K bytes; 228 KiB per SM on the H200).
# IMPRECISE_ACC > 0 passes `max_num_imprecise_acc` to tl.dot: the fp8 tensor-core partial sums are promoted
# to a full fp32 add every that many K elements (0 = Triton's default for the device).
ROWWISE_CANDIDATES: tuple[dict[str, int], ...] = (
    _cfg(128, 256, 128, 8, 3), _cfg(128, 256, 128, 8, 4), _cfg(128, 128, 128, 4, 4),
    _cfg(128, 128, 128, 8, 4), _cfg(128, 128, 128, 8, 5), _cfg(64, 128, 128, 4, 4),
    _cfg(64, 128, 128, 4, 6), _cfg(64, 256, 128, 4, 4), _cfg(64, 64, 128, 4, 6),
    _cfg(128, 128, 64, 4, 6), _cfg(256, 128, 128, 8, 3), _cfg(128, 256, 128, 8, 3, imprecise=128),
    _cfg(64, 128, 128, 4, 4, imprecise=128),
)


def rowwise_tile_config(m: int | None, n: int, k: int) -> dict[str, int]:
    """Tile config: from (N, K) only when `m` is None (invariant), else also from M (fast).

    Not measured yet (the defaults follow the bf16 sweep's shapes: 64-row tiles for decode-sized M, wide
    tiles for prefill); the invariant mode uses 64 x 128 for every M, so decode batches keep enough tiles
    to fill the GPU. benchmarks/bench_fp8.py --sweep prints the best candidate per shape.
    """
    del n, k  # kept in the signature: a per-shape table from the sweep returns here
    if m is None or m <= 64:
        return _cfg(64, 128, 128, 4, 4)
    if m <= 256:
        return _cfg(128, 128, 128, 8, 4)
    return _cfg(128, 256, 128, 8, 3)


@triton.jit(do_not_specialize=["M"])
def _rowwise_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K,
                         stride_am, stride_bn, stride_bsn, stride_om,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    offs_m, offs_n, rows, cols = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IMPRECISE_ACC > 0:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # Epilogue: (acc * s_x) * s_w, the reference's order of the two scalings.
    sa = tl.load(as_ptr + rows)
    sb = tl.load(bs_ptr + cols * stride_bsn)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rowwise_weight(weight: torch.Tensor, scale: torch.Tensor, k: int, device: torch.device) -> None:
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("weight_scale", scale, ndim=2, dtypes=(torch.float32,), device=device)
    if weight.shape[1] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match K={k}")
    if tuple(scale.shape) != (weight.shape[0], 1):
        raise ValueError(f"weight_scale: shape {tuple(scale.shape)}, expected ({weight.shape[0]}, 1) (one "
                         "scale per output channel; broadcast a per-tensor scale)")


def rowwise_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict[str, int]) -> torch.Tensor:
    """The GEMM alone on pre-quantized rows (xq e4m3 [M, K], xs [M, 1]); benchmarks time it separately."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = config
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _rowwise_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, IMPRECISE_ACC=cfg.get("IMPRECISE_ACC", 0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, invariant: bool = True,
                       config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K] e4m3, weight_scale [N, 1])^T (+ bias [N]) -> [M, N] in x's dtype,
    x quantized per row on the fly. `invariant`: the batch-invariant tile config; `config` overrides it."""
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    _check_rowwise_weight(weight, weight_scale, k, x.device)
    if m == 0 or weight.shape[0] == 0:
        return torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    xq, xs = quantize_rows(x)
    cfg = config or rowwise_tile_config(None if invariant else m, weight.shape[0], k)
    return rowwise_matmul(xq, xs, weight, weight_scale, bias, x.dtype, cfg)


def fp8_rowwise_linear_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                                 out_dtype: torch.dtype, invariant: bool = True,
                                 config: dict[str, int] | None = None) -> torch.Tensor:
    """`fp8_rowwise_linear` on rows the producing op already quantized: xq e4m3 [M, K] with float32 row
    scales xs [M, 1] (`quantize_rows`' contract, e.g. from kernels/fp8_fused_quant.py) -> [M, N] in
    `out_dtype`; bitwise `fp8_rowwise_linear(x)` when (xq, xs) == quantize_rows(x)."""
    check_tensor("xq", xq, ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor("xs", xs, ndim=2, dtypes=(torch.float32,), device=xq.device, last_dim_contiguous=False)
    m, k = xq.shape
    if tuple(xs.shape) != (m, 1) or (m > 1 and xs.stride(0) != 1):
        raise ValueError(f"xs: shape {tuple(xs.shape)} strides {tuple(xs.stride())}, expected ({m}, 1) "
                         "contiguous (one scale per row)")
    _check_rowwise_weight(weight, weight_scale, k, xq.device)
    cfg = config or rowwise_tile_config(None if invariant else m, weight.shape[0], k)
    return rowwise_matmul(xq, xs, weight, weight_scale, bias, out_dtype, cfg)
