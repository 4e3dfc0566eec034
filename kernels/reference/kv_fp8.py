"""FP8 (e4m3) KV cache, plain torch: the quantizing store, and the argument checks it shares with the kernel.

A cache entry of kv head h holds rtne(clamp(k / k_scale[h], +-448)) in e4m3; attention multiplies it back by
k_scale[h] after reading (kernels/reference/attention.py, kernels/paged_attention.py). Per-head scales are
float32 [Hkv] per layer, static (engine/models/quant/kv_fp8.py says how they are chosen).
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> e4m3 of x / scale[h], clamped to the e4m3 range (no NaN from an outlier)."""
    y = x.to(torch.float32) / scale.to(torch.float32).view(1, -1, 1)
    return torch.clamp(y, min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)


def check_store_fp8_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3, device=k.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4, dtypes=(FP8_DTYPE,), device=k.device)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=k.device)
        if t.shape[0] != k.shape[1]:
            raise ValueError(f"{name}: {t.shape[0]} scales for {k.shape[1]} kv heads")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=k.device,
                 last_dim_contiguous=False)
    if v.shape != k.shape or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}: expected k, v [T, Hkv, D] and caches [blocks, bs, Hkv, D]")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")


def store_kv_fp8_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Quantize k, v [T, Hkv, D] per kv head and write them at their slots (negative slots skipped)."""
    check_store_fp8_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = quantize_kv_ref(k[keep], k_scale)
    v_cache[slots // block_size, slots % block_size] = quantize_kv_ref(v[keep], v_scale)
