"""Rotary embedding and the paged KV-cache store in the epilogue of the merged qkv projection's GEMM.

A decode step of a small model otherwise runs the qkv GEMM, then kernels/rotary_store.py's kernel, which
reads q/k/v back, rotates q and k and writes k/v into the cache: one launch and one round trip of the qkv
output per layer. Here the GEMM's epilogue does that work on its tile while it is still in registers.

Bits: the weight's rows are in pair order (kernels/reference/rope_layout.py), so a tile holds both columns
of every (j, j + D/2) pair it touches. Each element is rounded to the activation dtype first, exactly as the
plain GEMM stores it, then `rotate_half_rounded` (the rotary kernel's own arithmetic: each product and the
sum rounded to the dtype, so no multiply-add can be contracted across a rounding) rotates it. The results
are those of the plain GEMM over the original rows followed by `rotary_store_kv`, bit for bit.

Writes: q (rotated) to the [T, Hq * D] output in the original column order; k (rotated) and v into the
caches at each token's slot (a negative slot, padding, stores nothing). Columns past the weight's rows and
rows past T are never stored. The GEMM kernels call `gemm_epilogue`, which picks this epilogue, the SwiGLU
one or the plain one by their constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.gemm_parts import linear_epilogue
from deepinfer.kernels.reference.rope_layout import RopeStore, qkv_rope_store_ref


@triton.jit
def rotate_half_rounded(x1, x2, c1, c2, s1, s2, like_ptr):
    """(first, second) halves of x * cos + rotate_half(x) * sin (float32 inputs), each product and the sum
    rounded to like_ptr's element type the way torch's elementwise ops round them. Shared by the rotary +
    KV-store kernel and this epilogue, so both compute the same bits.

    Every kernel calling it compiles with enable_fp_fusion=False: otherwise LLVM narrows the rounded
    products to 16-bit multiplies and fuses one of them with the sum into an fma.rn.bf16, dropping that
    product's rounding (on the H200 a fifth of q / k elements then differed by an ulp; the CPU interpreter
    never fuses)."""
    DTYPE = like_ptr.dtype.element_ty
    a1 = (x1 * c1).to(DTYPE).to(tl.float32)
    b1 = ((-x2) * s1).to(DTYPE).to(tl.float32)
    a2 = (x2 * c2).to(DTYPE).to(tl.float32)
    b2 = (x1 * s2).to(DTYPE).to(tl.float32)
    return (a1 + b1).to(DTYPE), (a2 + b2).to(DTYPE)


@triton.jit
def rope_store_epilogue(acc, b_ptr, q_ptr, offs_m, offs_n, M, N, stride_qm, cos_ptr, sin_ptr, stride_cos,
                        kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_cs, stride_ch, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, Q_COLS: tl.constexpr,
                        KV_COLS: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    """The qkv tile `acc` (fp32, columns in pair order) + bias, rounded, rotated and stored: q into q_ptr
    ([M, Q_COLS], row stride stride_qm), k and v into the caches (strides stride_cb / stride_cs / stride_ch
    per block / slot / head, unit along head_dim) at slot_ptr[row].

    Registers: every pair goes out through one pointer tensor (q's, k's or v's destination chosen per
    column) in two stores, and each token's cos / sin are read once per pair, from the row's first half:
    a rotate_half table's halves are equal (RopeStore)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.where(offs_n < N, offs_n, 0)).to(tl.float32)[None, :]
    y = acc.to(q_ptr.dtype.element_ty)
    a, b = tl.split(tl.reshape(y, (y.shape[0], BLOCK_N // 2, 2)))
    even, _ = tl.split(tl.reshape(offs_n, (BLOCK_N // 2, 2)))
    j = (even // 2) % HALF                      # the pair's place in its head
    col = (even // 2) // HALF * HEAD_DIM + j     # a's column in the original order (b's: col + HALF)
    row_ok = offs_m < M
    rows = tl.where(row_ok, offs_m, 0).to(tl.int64)
    trig = rows[:, None] * stride_cos + j[None, :]
    c = tl.load(cos_ptr + trig).to(tl.float32)
    s = tl.load(sin_ptr + trig).to(tl.float32)
    r1, r2 = rotate_half_rounded(a.to(tl.float32), b.to(tl.float32), c, c, s, s, q_ptr)
    is_q = col < Q_COLS
    kv = col - Q_COLS                            # k columns [0, KV_COLS), then v's
    is_v = kv >= KV_COLS
    in_cache = (kv >= 0) & (kv < 2 * KV_COLS)
    kv_head = tl.where(is_v, kv - KV_COLS, kv) // HEAD_DIM
    slot = tl.where(row_ok, tl.load(slot_ptr + rows), -1).to(tl.int64)
    slot_base = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
    row_off = tl.where(is_q[None, :], offs_m.to(tl.int64)[:, None] * stride_qm, slot_base[:, None])
    col_off = tl.where(is_q, col, kv_head * stride_ch + j)
    dest = tl.where(is_q, q_ptr, tl.where(is_v, vc_ptr, kc_ptr))
    ptrs = dest[None, :] + (row_off + col_off[None, :])
    mask = row_ok[:, None] & (is_q[None, :] | ((slot >= 0)[:, None] & in_cache[None, :]))
    tl.store(ptrs, tl.where(is_v[None, :], a, r1), mask=mask)
    tl.store(ptrs + HALF, tl.where(is_v[None, :], b, r2), mask=mask)


@triton.jit
def _column_quarters(t, BLOCK_N: tl.constexpr):
    """The four [.., BLOCK_N / 4] column ranges of a [BLOCK_N] or [rows, BLOCK_N] tile (each range whole
    rotary pairs: BLOCK_N / 4 is even), in one fixed order, so a tile and its column offsets split alike."""
    if len(t.shape) == 1:
        q = tl.permute(tl.reshape(t, (2, 2, BLOCK_N // 4)), (2, 0, 1))
    else:
        q = tl.permute(tl.reshape(t, (t.shape[0], 2, 2, BLOCK_N // 4)), (0, 3, 1, 2))
    lo, hi = tl.split(q)
    q0, q1 = tl.split(lo)
    q2, q3 = tl.split(hi)
    return q0, q1, q2, q3


@triton.jit
def gemm_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, cos_ptr, sin_ptr,
                  stride_cos, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_cs, stride_ch,
                  HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, Q_COLS: tl.constexpr, KV_COLS: tl.constexpr,
                  CACHE_BLOCK: tl.constexpr):
    """The batch-invariant 16-bit GEMMs' epilogue: under ROPE the qkv one above (out = q; ROPE = 4: the tile
    a quarter of its columns at a time, which bounds the registers of a large tile), else
    gemm_parts.linear_epilogue (plain or SWIGLU)."""
    if ROPE == 4:
        parts = _column_quarters(acc, BLOCK_N)
        cols = _column_quarters(offs_n, BLOCK_N)
        for i in tl.static_range(4):
            rope_store_epilogue(parts[i], b_ptr, out_ptr, offs_m, cols[i], M, N, stride_om, cos_ptr, sin_ptr,
                                stride_cos, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_cs, stride_ch,
                                HAS_BIAS, BLOCK_N // 4, HEAD_DIM, Q_COLS, KV_COLS, CACHE_BLOCK)
    elif ROPE:
        rope_store_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, cos_ptr, sin_ptr,
                            stride_cos, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_cs, stride_ch, HAS_BIAS,
                            BLOCK_N, HEAD_DIM, Q_COLS, KV_COLS, CACHE_BLOCK)
    else:
        linear_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWIGLU,
                        BLOCK_N)


def rope_kernel_args(rope: RopeStore | None, out: torch.Tensor, chunks: int = 1) -> tuple[tuple, dict]:
    """The GEMM kernels' rope operands: (cos, sin, cos row stride, k cache, v cache, slots, cache strides
    per block / slot / head) and their constexprs and compile options (`chunks`: `rope_epilogue_chunks` of
    the config); placeholders (never read) without a rope epilogue."""
    if rope is None:
        return ((out, out, 0, out, out, out, 0, 0, 0),
                dict(ROPE=0, HEAD_DIM=2, Q_COLS=0, KV_COLS=0, CACHE_BLOCK=1))
    kc = rope.k_cache
    # enable_fp_fusion=False: rotate_half_rounded's roundings survive compilation (its docstring). The rest
    # of the kernel has no multiply-add outside its MMAs, so this changes no other bit.
    return ((rope.cos, rope.sin, rope.cos.stride(0), kc, rope.v_cache, rope.slot_mapping, kc.stride(0),
             kc.stride(1), kc.stride(2)),
            dict(ROPE=chunks, HEAD_DIM=rope.head_dim, Q_COLS=rope.q_cols, KV_COLS=rope.kv_cols,
                 CACHE_BLOCK=kc.shape[1], enable_fp_fusion=False))



# Accumulator elements per thread up to which a tile runs the rope epilogue whole: the decode buckets' tiles
# hold 16-64 and compile without spills on sm_90 (Triton 3.6: 96-244 registers, no stack). The 128 x 256
# prefill tiles hold 128: whole, they spilled 1.0-1.5 KB of stack per thread; a quarter of the columns at a
# time, 0-32 bytes (benchmarks/RESULTS.md, 2026-12-05).
ROPE_WHOLE_TILE_ACC = 64
ROPE_QUARTERS_ACC = 128


def rope_epilogue_chunks(block_m: int, block_n: int, num_warps: int, split_k: int, serial_split: bool) -> int:
    """How a GEMM config runs the rope epilogue: 1 (the whole tile at once), 4 (a quarter of its columns at
    a time), or 0 (not at all: a tile too large for its registers, or a parallel split-K, whose reduce runs
    the epilogue and has no rope form; the projection then runs plain, then the rotary kernel). The same
    bits either way."""
    if split_k > 1 and not serial_split:
        return 0
    per_thread = block_m * block_n // (32 * num_warps)
    if per_thread <= ROPE_WHOLE_TILE_ACC:
        return 1
    return 4 if per_thread <= ROPE_QUARTERS_ACC and block_n >= 64 else 0


def rope_after(qkv: torch.Tensor, rope: RopeStore) -> torch.Tensor:
    """The epilogue's work on a plain GEMM output over the pair-ordered rows, by kernels/rotary_store.py (the
    GEMM forms without this epilogue: a parallel split-K, K = 0)."""
    from deepinfer.kernels.rotary_store import rotary_store_kv

    return qkv_rope_store_ref(qkv, rope, rotary_store_kv)
