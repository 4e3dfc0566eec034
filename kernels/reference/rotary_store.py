"""Plain-torch reference of rotary embedding fused with the KV-cache store; argument checks the kernel shares.

The rotation is transformers' rotate_half (NeoX, non-interleaved) convention computed in the activation
dtype: `x * cos + rotate_half(x) * sin`, each product and the sum rounded to that dtype, as torch's
elementwise ops round them. The fused op is that rotation of q and k followed by `store_kv_ref` of the
rotated k and the untouched v; its FP8-cache form follows the rotation with `store_kv_fp8_ref` instead (the
rotated k, still in the activation dtype, and v quantized per kv head into e4m3 caches).
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.reference.kv_fp8 import check_store_fp8_args, store_kv_fp8_ref
from deepinfer.kernels.reference.store_kv import check_store_args, store_kv_ref


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated with the rotate_half convention; cos/sin broadcast against x, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def check_rotary_store_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """ValueError naming the argument unless the fused op's operands fit (see `rotary_store_kv_ref`)."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    _check_rotary_operands(q, k, cos, sin)


def check_rotary_store_fp8_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """ValueError naming the argument unless the FP8-cache op's operands fit (`rotary_store_kv_fp8_ref`)."""
    check_store_fp8_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_same_dtype("v", v, k.dtype)
    _check_rotary_operands(q, k, cos, sin)


def _check_rotary_operands(q, k, cos, sin) -> None:
    """q [T, Hq, D] and cos/sin [T, D] in k's dtype, D even, T and D matching k."""
    check_tensor("q", q, ndim=3, device=k.device)
    check_same_dtype("q", q, k.dtype)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q: shape {tuple(q.shape)} does not match k {tuple(k.shape)} in tokens and head_dim")
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"q: head_dim {head_dim} must be even for rotate_half rotary embeddings")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, device=k.device)
        check_same_dtype(name, t, k.dtype)
        if tuple(t.shape) != (q.shape[0], head_dim):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [tokens, head_dim] = "
                             f"{[q.shape[0], head_dim]} (one row per token, in the activation dtype)")


def rotary_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated q [T, Hq, D] (a new tensor); rotated k and v [T, Hkv, D] written into the paged caches.

    cos/sin [T, D] hold each token's row of the rotary table in q's dtype. The caches are
    [num_blocks, block_size, Hkv, D]; token t goes to slot_mapping[t] (negative: not stored), as in
    `store_kv_ref`.
    """
    check_rotary_store_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    store_kv_ref(rotate_half_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return rotate_half_ref(q, cos, sin)


def rotary_store_kv_fp8_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> torch.Tensor:
    """`rotary_store_kv_ref` into e4m3 caches: q and k rotated in the activation dtype, then the rotated k
    and v quantized by the float32 per-kv-head k_scale / v_scale [Hkv] (`store_kv_fp8_ref`) at their slots.
    Returns the rotated q [T, Hq, D]."""
    check_rotary_store_fp8_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    store_kv_fp8_ref(rotate_half_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return rotate_half_ref(q, cos, sin)
