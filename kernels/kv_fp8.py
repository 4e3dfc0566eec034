"""Write this step's keys/values into an FP8 (e4m3) paged KV cache, quantized per kv head.

Bitwise `store_kv_fp8_ref`: x / scale[h] in float32 (IEEE division), clamped to +-448, rounded to nearest
even on the e4m3 grid. Row-local, so it never depends on the batch. `quantize_e4m3` is that arithmetic for
any kernel writing this cache (kernels/rotary_store.py's FP8 form uses it), so the two cannot drift apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.reference.kv_fp8 import FP8_MAX, check_store_fp8_args


@triton.jit
def quantize_e4m3(x, scale, QMAX: tl.constexpr, out_ptr):
    """float32 x / scale (broadcast) as out_ptr's e4m3 element type: clamped to +-QMAX, rounded to nearest
    even (kernels/e4m3.py's step in its interpreter form, IEEE division and integer rounding, on every
    device: the GPU form has not been measured on this store)."""
    return e4m3_quotient(x, scale, QMAX, False).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def _store_kv_fp8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QMAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots mark padding tokens that own no cache slot
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        hs = tl.arange(0, BLOCK_H)
        h = hs[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        ks = tl.load(k_scale_ptr + hs, mask=hs < NUM_HEADS, other=1.0)[:, None]
        vs = tl.load(v_scale_ptr + hs, mask=hs < NUM_HEADS, other=1.0)[:, None]
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
                 quantize_e4m3(k, ks, QMAX, k_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
                 quantize_e4m3(v, vs, QMAX, v_cache_ptr), mask=mask)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Quantize k, v [T, Hkv, D] by k_scale / v_scale [Hkv] into the e4m3 caches at their slots."""
    check_store_fp8_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_fp8_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=max(2, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], QMAX=FP8_MAX, num_warps=4,
    )
