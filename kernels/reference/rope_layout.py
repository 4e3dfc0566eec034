"""The merged qkv projection with rotary + KV store in its GEMM's epilogue: the weight's row order, the
operands the epilogue takes, and the plain-torch composition it must equal (no Triton here: the CPU path and
the engine's shared ops import it).

The epilogue rotates each q/k head's column pairs (j, j + D/2) in registers, so both columns of a pair must
sit in one output tile, next to each other: the weight (and bias) rows of every head are reordered x_0,
x_{D/2}, x_1, x_{D/2+1}, ... (`interleave_head_halves`) at load, the way a SwiGLU epilogue's gate_up rows
alternate gate j, up j. The GEMM's elements are the same dot chains, only in other columns, so the fused form
can equal the plain GEMM on the original rows followed by the rotary + KV-store kernel bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.reference.activation import pairs_to_halves


def interleave_head_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a [heads * head_dim, ...] weight or bias reordered per head x_0, x_{D/2}, x_1, ... (the rope
    epilogue's order); any dtype, a new contiguous tensor."""
    rows = t.shape[0]
    if head_dim % 2 or rows % head_dim:
        raise ValueError(f"interleave_head_halves: {rows} rows, expected whole heads of an even head_dim "
                         f"({head_dim})")
    half = head_dim // 2
    order = torch.arange(rows, device=t.device).view(-1, 2, half).transpose(1, 2).reshape(-1)
    return t.index_select(0, order).contiguous()


def head_pairs_to_halves(out: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `interleave_head_halves` on a GEMM output's columns: [M, heads * head_dim] with each
    head's columns in pair order -> the original order (a new contiguous tensor): activation.pairs_to_halves
    of every head's row."""
    return pairs_to_halves(out.reshape(-1, head_dim)).view(out.shape)


@dataclass(frozen=True)
class RopeStore:
    """What a qkv GEMM with the rope epilogue needs besides x and the weight: each token's cos/sin row
    [T, D] (the activation dtype), the paged caches [num_blocks, block_size, Hkv, D] (the same dtype and
    layout) and each token's slot (negative: padding, nothing stored). The GEMM returns the rotated q
    [T, Hq * D]; the rotated k and v go into the caches.

    The two halves of every cos / sin row must be equal, as in every rotate_half table (cos(cat(freqs,
    freqs)); engine/layers/rotary.py): the epilogue reads the first half for both, which halves its loads
    and registers. Not checked per call (that would read the rows back)."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_cols(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_cols(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """ValueError naming the operand unless this fits a GEMM of x [T, K] by weight [N, K]."""
        d = self.head_dim
        if d % 2 or d < 2:
            raise ValueError(f"head_dim={d}: must be even for rotate_half rotary embeddings")
        if weight.shape[0] != self.q_cols + 2 * self.kv_cols:
            raise ValueError(f"weight: {weight.shape[0]} rows, expected q + k + v = "
                             f"{self.q_cols} + 2 * {self.kv_cols} for the rope epilogue")
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"x: {x.dtype}; the rope epilogue covers 16-bit activations only")
        tokens = x.shape[0]
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            check_tensor(name, t, ndim=2, device=x.device)
            check_same_dtype(name, t, x.dtype)
            if tuple(t.shape) != (tokens, d) or t.stride(1) != 1:
                raise ValueError(f"{name}: shape {tuple(t.shape)} (strides {t.stride()}), expected "
                                 f"[tokens, head_dim] = {[tokens, d]} with unit column stride")
        if self.cos.stride(0) != self.sin.stride(0):
            raise ValueError(f"cos/sin: row strides {self.cos.stride(0)} and {self.sin.stride(0)} differ")
        for name, cache in (("k_cache", self.k_cache), ("v_cache", self.v_cache)):
            check_tensor(name, cache, ndim=4, device=x.device)
            check_same_dtype(name, cache, x.dtype)
            if tuple(cache.shape[2:]) != (self.num_kv_heads, d):
                raise ValueError(f"{name}: (heads, head_dim) {tuple(cache.shape[2:])}, expected "
                                 f"{(self.num_kv_heads, d)}")
        check_tensor("slot_mapping", self.slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                     device=x.device, last_dim_contiguous=False)
        if self.slot_mapping.shape[0] != tokens:
            raise ValueError(f"slot_mapping: {self.slot_mapping.shape[0]} slots for {tokens} tokens")
        if tokens > 1 and self.slot_mapping.stride(0) != 1:
            raise ValueError(f"slot_mapping: stride {self.slot_mapping.stride(0)}; the rope epilogue reads "
                             "it contiguous")
        if self.k_cache.stride() != self.v_cache.stride() or self.k_cache.stride(3) != 1:
            raise ValueError(f"k_cache / v_cache: strides {self.k_cache.stride()} and {self.v_cache.stride()}"
                             "; the rope epilogue needs one layout with unit head_dim stride")


def qkv_rope_store_ref(qkv: torch.Tensor, rope: RopeStore, rotary_store) -> torch.Tensor:
    """What the rope epilogue must equal, from the GEMM's plain output `qkv` over the reordered rows: its
    columns put back in order, then `rotary_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)` (the
    rotary + KV-store kernel or its reference), which stores k / v and returns the rotated q; q as
    [T, Hq * D]."""
    tokens, d = qkv.shape[0], rope.head_dim
    q, k, v = head_pairs_to_halves(qkv, d).split([rope.q_cols, rope.kv_cols, rope.kv_cols], dim=-1)
    q_rot = rotary_store(q.reshape(tokens, rope.num_q_heads, d), k.reshape(tokens, rope.num_kv_heads, d),
                         v.reshape(tokens, rope.num_kv_heads, d), rope.cos, rope.sin, rope.k_cache,
                         rope.v_cache, rope.slot_mapping)
    return q_rot.reshape(tokens, rope.q_cols)
