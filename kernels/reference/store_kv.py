"""Plain-torch reference of the KV-cache store, and the argument checks both versions share."""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor


def check_store_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3, device=k.device)
    check_tensor("k_cache", k_cache, ndim=4, device=k.device)
    check_tensor("v_cache", v_cache, ndim=4, device=k.device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=k.device,
                 last_dim_contiguous=False)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_same_dtype(name, t, k.dtype)
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k_cache: (heads, head_dim) {tuple(k_cache.shape[2:])} differ from k's {tuple(k.shape[1:])}"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference of `store_kv` (same in-place effect)."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]
