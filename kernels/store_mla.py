"""Write MLA's latent and rope key into the paged latent cache (Triton), one program per token.

The cache is [num_blocks, block_size, R + P]; token t's latent [R] and rope key [P] (strided views of the
kv_a projection output are fine) go to the entry at flat slot slot_mapping[t]; negative slots (padding
rows) are skipped on the device, so the step needs no host synchronisation (the reference's boolean
indexing does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.reference.mla import store_mla_ref

__all__ = ["store_mla", "store_mla_ref"]


@triton.jit
def _store_mla_kernel(lat_ptr, pe_ptr, cache_ptr, slot_ptr, stride_lt, stride_pt, stride_cb, stride_cs,
                      BLOCK_SIZE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    entry = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    r = tl.arange(0, BLOCK_R)
    lat = tl.load(lat_ptr + t * stride_lt + r, mask=r < RANK)
    tl.store(entry + r, lat.to(cache_ptr.dtype.element_ty), mask=r < RANK)
    p = tl.arange(0, BLOCK_P)
    pe = tl.load(pe_ptr + t * stride_pt + p, mask=p < ROPE)
    tl.store(entry + RANK + p, pe.to(cache_ptr.dtype.element_ty), mask=p < ROPE)


def store_mla(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """latent [T, R], k_pe [T, P] (last dims contiguous) into cache [blocks, block_size, R + P] at slots."""
    from deepinfer.kernels._checks import check_tensor

    check_tensor("latent", latent, ndim=2)
    check_tensor("k_pe", k_pe, ndim=2, device=latent.device)
    check_tensor("cache", cache, ndim=3, device=latent.device)
    rank, rope = latent.shape[1], k_pe.shape[1]
    if latent.shape[0] != k_pe.shape[0] or rank + rope != cache.shape[2]:
        raise ValueError(f"latent {tuple(latent.shape)} + k_pe {tuple(k_pe.shape)} do not fill cache entries "
                         f"of width {cache.shape[2]}")
    if slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {latent.shape[0]} tokens")
    if latent.shape[0] == 0:
        return
    _store_mla_kernel[(latent.shape[0],)](
        latent, k_pe, cache, slot_mapping, latent.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        BLOCK_SIZE=cache.shape[1], RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(rope), num_warps=4,
    )
