"""CPU ops backends: batch-invariant pure torch (deterministic) and plain torch (fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.attention import chunked_paged_attention, paged_attention_ref
from deepinfer.kernels.reference.matmul import row_invariant_mm
from deepinfer.kernels.reference.mla import mla_attention_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
from deepinfer.kernels.reference.tiled_attention import tiled_paged_attention


class CpuInvariantOps(Ops):
    """Batch-invariant CPU ops: `f(x)[i]` is bitwise `f(x[i:i+1])[0]` for every op."""

    name = "cpu-invariant"
    deterministic = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # torch.mm on CPU is not row-invariant (its kernel may depend on M); row_invariant_mm gives row i
        # the bits of torch.mm over a fixed 16-row chunk, whatever else shares the call.
        out = row_invariant_mm(x, weight)
        return out + bias if bias is not None else out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps, invariant=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x, invariant=True)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # GEMM tiles where this CPU's BLAS passed their probe (the same answer for every call of a
        # process, so a token always gets one definition of its bits); the elementwise chunks elsewhere.
        out = tiled_paged_attention(q, k_cache, v_cache, meta, scale)
        return out if out is not None else chunked_paged_attention(q, k_cache, v_cache, meta, scale)

    def attention_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
        out = tiled_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        if out is None:
            out = chunked_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        return out


class CpuFastOps(Ops):
    """Plain torch CPU ops (not batch-invariant): the simple, correct reference path."""

    name = "cpu-fast"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
        # Not batch-invariant: prefill rows expand the latents to per-head K/V, decode rows absorb.
        return mla_attention_ref(q_nope, q_pe, cache, meta, kv_b_weight, scale)
