"""Fused routed-expert MoE (Triton): tokens sorted by expert, grouped GEMMs, combine in a fixed order.

Given each token's chosen experts ids [T, K] and routing weights [T, K], `fused_moe` computes
sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])) with e = ids[t, k]:

1. `moe_align` (torch ops on the device, no host sync): the T*K (token, slot) assignments are stably sorted
   by expert (ties keep assignment order), and each expert's run is padded to a multiple of BLOCK_M rows,
   so every row block of the sorted list belongs to one expert. Blocks past the real ones are marked -1
   (the grid is sized by an upper bound, T*K + E*(BLOCK_M-1) rows, so no count is read on the host).
2. `_gate_up_kernel`: per (row block, column block), the block's expert's gate and up rows times the rows'
   tokens, two fp32 accumulators, silu(gate) * up in fp32, stored in x's dtype: h [rows, I]. With
   `swiglu_limit` (DeepSeek-V4's clipped SwiGLU; the CLIP constexpr variant, so the default kernel is
   unchanged) the fp32 accumulators are clamped first: gate <= limit, -limit <= up <= limit.
3. `_down_kernel`: h @ down[e]^T per row block: y [rows, H].
4. `_combine_kernel`: out[t] = sum_k weights[t, k] * y[row of (t, k)], k in slot order (the routers sort
   slots by expert id), fp32, one program per token: no atomics.

Batch invariance: a row's GEMM results are fp32 accumulations over K in BLOCK_K tiles in increasing order
by one `tl.dot` chain whose tile config depends on (N, K, dtype) only; padding rows read token 0 and are
never stored, so a token's bits do not depend on which or how many other tokens chose the same expert, or
where in a block it lands. The combine is per token in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.reference.fused_moe import check_fused_moe_args, check_swiglu_limit

__all__ = ["fused_moe", "moe_align", "moe_tile_config", "combine_rows"]


def moe_tile_config(n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config of a grouped GEMM with weights [E, n, k]: a function of the weight shape and dtype."""
    del n, k  # one config for every shape; kept so that a shape policy stays batch-free
    if dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort assignments by expert, padded per expert to whole row blocks (all on the device).

    Returns (sorted_ids int32 [P]: assignment index t*K+k of each padded row or -1, block_expert int32
    [P // block_m]: the expert of each row block or -1 past the last, row_of int64 [T*K]: the padded row
    of each assignment). P = an upper bound of the padded length, from the shapes only.
    """
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    # Run boundaries by binary search (no atomics, allowed under torch's deterministic-algorithms mode).
    edges = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=dev))
    cstart, counts = edges[:-1], edges[1:] - edges[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    dest = (pend - padded)[sorted_expert] + torch.arange(n, device=dev) - cstart[sorted_expert]
    num_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    row_of = torch.empty(n, dtype=torch.int64, device=dev)
    row_of[order] = dest
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pend, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, row_of


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr,
    N, K, stride_xt, stride_we, stride_wn, stride_wk, limit,
    TOP_K: tl.constexpr, IEEE: tl.constexpr, CLIP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ptr + rows)
    valid = assign >= 0
    tok = tl.where(valid, assign // TOP_K, 0).to(tl.int64)     # padding rows read token 0, never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    g_ptrs = w_base + cols[None, :] * stride_wn
    u_ptrs = w_base + (cols + N)[None, :] * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - ki * BLOCK_K
        a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if CLIP:
        # torch.clamp's semantics on the fp32 accumulators: gate clamped from above only, up both ways; a
        # NaN compares false and stays NaN.
        acc_g = tl.where(acc_g > limit, limit, acc_g)
        acc_u = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    N, K, stride_we, stride_wn, stride_wk,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tl.load(sorted_ptr + rows) >= 0
    src = tl.where(valid, rows, pid_m * BLOCK_M).to(tl.int64)  # a block's first row is always real
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + src[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - ki * BLOCK_K
        a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _combine_kernel(y_ptr, w_ptr, row_of_ptr, out_ptr, H, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):          # slot order: one fixed summation order per token
        row = tl.load(row_of_ptr + t * TOP_K + k)
        weight = tl.load(w_ptr + t * TOP_K + k)
        total += weight * tl.load(y_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, invariant: bool = True, swiglu_limit: float | None = None) -> torch.Tensor:
    """Routed experts' weighted sum: x [T, H], ids/weights [T, K], gate_up [E, 2I, H], down [E, H, I].

    Returns [T, H] in x's dtype. weights are float32 (as the routers give them); ids int32/int64.
    `invariant=False` (fast mode) lets small batches take 16-row blocks (less padding work when each expert
    gets a few tokens); a different block shape may round differently, so deterministic mode never does.
    `swiglu_limit` (a positive float) clips the activation's inputs: silu(min(gate, limit)) *
    clamp(up, -limit, limit), as DeepSeek-V4's experts do; None is the plain SwiGLU.
    """
    check_fused_moe_args(x, ids, weights, gate_up, down)
    check_swiglu_limit(swiglu_limit)
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    cfg1 = moe_tile_config(two_inter, hidden, x.dtype)
    cfg2 = moe_tile_config(hidden, inter, x.dtype)
    if cfg1["BLOCK_M"] != cfg2["BLOCK_M"]:
        raise ValueError("both grouped GEMMs must share BLOCK_M (one expert-sorted row layout)")
    block_m = cfg1["BLOCK_M"]
    if not invariant and num_tokens * top_k <= 16 * num_experts:
        block_m = 16
    sorted_ids, block_expert, row_of = moe_align(ids, num_experts, block_m)
    rows = sorted_ids.shape[0]
    h = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    _gate_up_kernel[(block_expert.shape[0], triton.cdiv(inter, cfg1["BLOCK_N"]))](
        x, gate_up, h, sorted_ids, block_expert,
        inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        float(swiglu_limit or 0.0),   # fp32 kernel argument; unread unless CLIP
        TOP_K=top_k, IEEE=ieee, CLIP=swiglu_limit is not None,
        BLOCK_M=block_m, BLOCK_N=cfg1["BLOCK_N"], BLOCK_K=cfg1["BLOCK_K"],
        num_warps=cfg1["num_warps"], num_stages=cfg1["num_stages"],
    )
    _down_kernel[(block_expert.shape[0], triton.cdiv(hidden, cfg2["BLOCK_N"]))](
        h, down, y, sorted_ids, block_expert,
        hidden, inter, down.stride(0), down.stride(1), down.stride(2),
        IEEE=ieee, BLOCK_M=block_m, BLOCK_N=cfg2["BLOCK_N"], BLOCK_K=cfg2["BLOCK_K"],
        num_warps=cfg2["num_warps"], num_stages=cfg2["num_stages"],
    )
    return combine_rows(y, weights, row_of, out)


def combine_rows(y: torch.Tensor, weights: torch.Tensor, row_of: torch.Tensor, out: torch.Tensor
                 ) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of[t * K + k]] (k in slot order, float32, one program per
    token: no atomics), for expert-sorted rows y [rows, H] (contiguous), float32 weights [T, K] and the
    flat (token, slot) -> row map row_of [T * K]; writes and returns out [T, H] (its dtype)."""
    num_tokens, top_k = weights.shape
    hidden = y.shape[1]
    if (y.stride() != (hidden, 1) or row_of.shape != (num_tokens * top_k,)
            or out.shape != (num_tokens, hidden)):
        raise ValueError(f"combine_rows: y {tuple(y.shape)} (contiguous), row_of {tuple(row_of.shape)} and "
                         f"out {tuple(out.shape)} must be [rows, H], [T*K] and [T, H] for weights "
                         f"{tuple(weights.shape)}")
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, weights.contiguous(), row_of.contiguous(), out, hidden, out.stride(0), TOP_K=top_k,
        BLOCK_H=block_h, num_warps=4,
    )
    return out
