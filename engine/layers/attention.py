"""Self-attention layer over the paged KV cache: merged qkv projection, optional q/k norm, RoPE, GQA."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.rope_layout import RopeStore, head_pairs_to_halves, interleave_head_halves
from torch import nn


class PagedSelfAttention(nn.Module):
    """`qkv_proj.weight` rows are [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]; q_norm/k_norm (Qwen3) are per head."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, rms_norm_eps: float,
                 ops: Ops, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.ops = ops
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, ops, dtype, device)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, ops, dtype, device)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, ops, dtype, device)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, ops, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        # Per-kv-head scales of an FP8 KV cache (static 1.0; engine/models/quant/kv_fp8.py says why).
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device),
                             persistent=False)
        # Set by `order_qkv_for_rope` (after loading): qkv_proj's rows are in per-head pair order and rotary +
        # KV store run in its GEMM's epilogue (`Ops.qkv_rope_store`).
        self.rope_in_qkv = False

    @torch.no_grad()
    def order_qkv_for_rope(self, kv_cache_dtype: torch.dtype) -> bool:
        """Put qkv_proj's weight (and bias) rows in per-head pair order (kernels/reference/rope_layout.py)
        where the ops backend runs rotary + KV store in the GEMM's epilogue and the layer qualifies: 16-bit
        weights, a cache in the same dtype, no q/k norm between the projection and the rotation. Once;
        returns whether the layer now runs that way."""
        proj = self.qkv_proj
        if self.rope_in_qkv:
            return True
        sixteen_bit = proj.weight.dtype in (torch.bfloat16, torch.float16)
        if not self.ops.rope_in_16bit_qkv or self.q_norm is not None or not sixteen_bit:
            return False
        if kv_cache_dtype != proj.weight.dtype:
            return False
        proj.weight.copy_(interleave_head_halves(proj.weight, self.head_dim))
        if proj.bias is not None:
            proj.bias.copy_(interleave_head_halves(proj.bias, self.head_dim))
        self.rope_in_qkv = True
        return True

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], into_norm: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `into_norm`: as `Linear.forward`'s, for o_proj."""
        num_tokens = x.shape[0]
        cos, sin = rope
        k_cache, v_cache = kv_cache
        if self.rope_in_qkv and k_cache.dtype == x.dtype:
            store = RopeStore(cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1), k_cache, v_cache,
                              meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            q = self.ops.qkv_rope_store(x, self.qkv_proj.weight, self.qkv_proj.bias, store)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        else:
            out = self._attend(x, cos, sin, meta, k_cache, v_cache)
        return self.o_proj(out.reshape(num_tokens, self.q_size), into_norm)

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Projection, q/k norm, rotary + KV store, attention as separate ops: [T, Hq, D]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.rope_in_qkv:   # pair-ordered rows but an e4m3 cache: the columns back in order first
            qkv = head_pairs_to_halves(qkv, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # One op for rotate q, rotate k, store k/v (quantized per kv head into an e4m3 cache): the CUDA
        # backends fuse it into one kernel launch.
        if k_cache.dtype == torch.float8_e4m3fn:  # kv_cache_dtype="fp8"
            q = self.ops.rotary_store_kv_fp8(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                             self.k_scale, self.v_scale)
            return self.ops.attention_fp8(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale)
        q = self.ops.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return self.ops.attention(q, k_cache, v_cache, meta, self.scale)

def order_qkv_for_rope(model: nn.Module, kv_cache_dtype: torch.dtype) -> int:
    """`PagedSelfAttention.order_qkv_for_rope` on every such layer of a loaded model (engine/llm.py calls it
    once the weights are in, when the cache dtype is known); returns how many layers now take that path."""
    layers = [m for m in model.modules() if isinstance(m, PagedSelfAttention)]
    return sum(m.order_qkv_for_rope(kv_cache_dtype) for m in layers)
