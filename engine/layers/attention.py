"""Self-attention layer over the paged KV cache: merged qkv projection, optional q/k norm, RoPE, GQA."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], into_norm: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `into_norm`: as `Linear.forward`'s, for o_proj."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        k_cache, v_cache = kv_cache
        # One op for rotate q, rotate k, store k/v (quantized per kv head into an e4m3 cache): the CUDA
        # backends fuse it into one kernel launch.
        if k_cache.dtype == torch.float8_e4m3fn:  # kv_cache_dtype="fp8"
            q = self.ops.rotary_store_kv_fp8(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                             self.k_scale, self.v_scale)
            out = self.ops.attention_fp8(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale)
        else:
            q = self.ops.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
            out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size), into_norm)
