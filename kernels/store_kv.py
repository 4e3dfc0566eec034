"""Write this step's keys/values into the paged KV cache (slot = block * block_size + offset)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.reference.store_kv import check_store_args


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots mark padding tokens that own no cache slot
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k, v [T, Hkv, D] into k_cache, v_cache [num_blocks, block_size, Hkv, D] in place.

    Token t goes to block slot_mapping[t] // block_size, offset slot_mapping[t] % block_size; tokens with a
    negative slot are skipped.
    """
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=max(2, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4,
    )
