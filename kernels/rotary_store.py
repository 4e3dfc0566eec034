"""Rotary embedding of q and k fused with the paged KV-cache store: one launch per attention layer.

Replaces the composition `apply_rotary(q)`, `apply_rotary(k)`, `store_kv(k, v)` (per layer: neg, cat, two
muls and an add on q and again on k, then the store) with one kernel that gives the same bits. The
rotation follows transformers' rotate_half convention in the activation dtype, and each step is rounded
where torch's elementwise ops round it: `x * cos` and `rotate_half(x) * sin` are each rounded to the dtype,
then their sum is. The products of two bf16/fp16 values are exact in float32, so rounding them once matches
torch exactly; floating-point contraction is switched off so that float32 inputs never get a fused
multiply-add torch would not do. Every element depends only on its own token: batch-invariant.

Grid: (tokens, q-head blocks + kv-head blocks). A program rotates one block of a token's q heads into
the output, or rotates one block of its k heads and writes them with the same v heads into the cache at
slot_mapping[t] (a negative slot, padding, writes nothing).

An FP8 (e4m3) cache (KV_FP8) takes the same launch: the rotated k, rounded to the activation dtype as the
unfused rotary would hand it over, and v are quantized per kv head with kernels/kv_fp8.py's arithmetic, so
the cache gets bitwise what rotary followed by `store_kv_fp8` writes (`rotary_store_kv_fp8_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.kv_fp8 import quantize_e4m3
from deepinfer.kernels.pdl import pdl_options, wait_for_producers
from deepinfer.kernels.reference.kv_fp8 import FP8_DTYPE, FP8_MAX
from deepinfer.kernels.reference.rotary_store import check_rotary_store_args, check_rotary_store_fp8_args

# Elements (heads x head_dim) one program handles: enough work per program to hide load latency, small
# enough that a decode step of a few tokens still spreads over many SMs.
_ELEMS_PER_PROGRAM = 1024


@triton.jit
def _rotate_half(x1, x2, c1, c2, s1, s2, out_ptr):
    """(first, second) halves of x * cos + rotate_half(x) * sin (float32 inputs), each product and the sum
    rounded to out_ptr's element type the way torch's elementwise ops round them. Those roundings hold
    because the kernel compiles with enable_fp_fusion=False: with fusion, LLVM narrows the rounded products
    to 16-bit multiplies and fuses one into the sum (an fma.rn.bf16, one rounding fewer; seen on the H200
    in a GEMM epilogue with this arithmetic, benchmarks/RESULTS.md 2026-12-05 02:40)."""
    DTYPE = out_ptr.dtype.element_ty
    a1 = (x1 * c1).to(DTYPE).to(tl.float32)
    b1 = ((-x2) * s1).to(DTYPE).to(tl.float32)
    a2 = (x2 * c2).to(DTYPE).to(tl.float32)
    b2 = (x1 * s2).to(DTYPE).to(tl.float32)
    return (a1 + b1).to(DTYPE), (a2 + b2).to(DTYPE)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_Q_BLOCKS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, QMAX: tl.constexpr, PDL: tl.constexpr = 0,
):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load or store
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    if j < NUM_Q_BLOCKS:
        qh = j * BLOCK_HQ + tl.arange(0, BLOCK_HQ)[:, None]
        q_mask = (qh < NUM_Q_HEADS) & d_mask
        q_src = q_ptr + t * stride_qt + qh * stride_qh + d
        q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
        q_rot1, q_rot2 = _rotate_half(q1, q2, c1, c2, s1, s2, q_out_ptr)
        q_dst = q_out_ptr + t * stride_ot + qh * stride_oh + d
        tl.store(q_dst, q_rot1, mask=q_mask)
        tl.store(q_dst + HALF, q_rot2, mask=q_mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # negative slots mark padding tokens that own no cache slot
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            kh = (j - NUM_Q_BLOCKS) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None]
            kv_mask = (kh < NUM_KV_HEADS) & d_mask
            k_src = k_ptr + t * stride_kt + kh * stride_kh + d
            k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
            k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kh * stride_kch + d
            v_src = v_ptr + t * stride_vt + kh * stride_vh + d
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kh * stride_vch + d
            if KV_FP8:
                # Rotated k rounded to the activation dtype (q_out's) first: what the unfused rotary hands
                # store_kv_fp8; then the same per-head quantization as that kernel, elementwise.
                k_rot1, k_rot2 = _rotate_half(k1, k2, c1, c2, s1, s2, q_out_ptr)
                ks = tl.load(k_scale_ptr + kh, mask=kh < NUM_KV_HEADS, other=1.0)
                vs = tl.load(v_scale_ptr + kh, mask=kh < NUM_KV_HEADS, other=1.0)
                tl.store(k_dst, quantize_e4m3(k_rot1.to(tl.float32), ks, QMAX, k_cache_ptr), mask=kv_mask)
                tl.store(k_dst + HALF, quantize_e4m3(k_rot2.to(tl.float32), ks, QMAX, k_cache_ptr),
                         mask=kv_mask)
                v1 = tl.load(v_src, mask=kv_mask, other=0.0).to(tl.float32)
                v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
                tl.store(v_dst, quantize_e4m3(v1, vs, QMAX, v_cache_ptr), mask=kv_mask)
                tl.store(v_dst + HALF, quantize_e4m3(v2, vs, QMAX, v_cache_ptr), mask=kv_mask)
            else:
                k_rot1, k_rot2 = _rotate_half(k1, k2, c1, c2, s1, s2, k_cache_ptr)
                tl.store(k_dst, k_rot1, mask=kv_mask)
                tl.store(k_dst + HALF, k_rot2, mask=kv_mask)
                tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
                tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


def _head_block(num_heads: int, block_half: int) -> int:
    """Heads per program: about _ELEMS_PER_PROGRAM elements, a power of two, no more than the heads."""
    cap = max(2, _ELEMS_PER_PROGRAM // (2 * block_half))
    return max(2, min(cap, triton.next_power_of_2(num_heads)))


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] into a new contiguous tensor (returned) and k [T, Hkv, D]; write the rotated k
    and v into k_cache, v_cache [num_blocks, block_size, Hkv, D] in place.

    cos/sin [T, D]: each token's rotary row in q's dtype. q, k, v may be strided views (e.g. the column
    slices of a merged qkv projection) as long as their last dim is contiguous. Token t goes to block
    slot_mapping[t] // block_size, offset slot_mapping[t] % block_size; a negative slot stores nothing
    (its q is still rotated). Bitwise equal to `rotary_store_kv_ref`; with e4m3 caches and float32
    per-kv-head k_scale / v_scale [Hkv], bitwise `rotary_store_kv_fp8_ref`.
    """
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if kv_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale, v_scale: an e4m3 cache needs its float32 per-kv-head scales [Hkv]")
        check_rotary_store_fp8_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale, v_scale: only an e4m3 cache takes scales, not a {k_cache.dtype} one")
        check_rotary_store_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    block_half = max(16, triton.next_power_of_2(half))
    block_hq, block_hkv = _head_block(num_q_heads, block_half), _head_block(num_kv_heads, block_half)
    num_q_blocks = triton.cdiv(num_q_heads, block_hq)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_hkv))
    _rotary_store_kv_kernel[grid](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        k_scale if kv_fp8 else slot_mapping, v_scale if kv_fp8 else slot_mapping,   # unread unless KV_FP8
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, NUM_Q_BLOCKS=num_q_blocks, HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=kv_fp8, QMAX=FP8_MAX, num_warps=4, enable_fp_fusion=False, **pdl_options(q.device),
    )
    return q_out
