"""CPU ops backends: batch-invariant pure torch (deterministic) and plain torch (fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.reference.matmul import row_invariant_mm
from deepinfer.kernels.reference.mla import mla_attention_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
from deepinfer.kernels.reference.tiled_attention import (
    AttentionPlan,
    plan_attention,
    plan_key,
    tiled_paged_attention,
)


class CpuInvariantOps(Ops):
    """Batch-invariant CPU ops: `f(x)[i]` is bitwise `f(x[i:i+1])[0]` for every op."""

    name = "cpu-invariant"
    deterministic = True

    def __init__(self) -> None:
        # The attention plan of the step being run: every layer of a step has the same metadata, so the
        # tiling and its index tensors are built once per step, not once per layer (checked by value).
        self._plan: AttentionPlan | None = None

    def _attention_plan(self, q: torch.Tensor, k_cache: torch.Tensor,
                        meta: AttentionMetadata) -> AttentionPlan:
        key = plan_key(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
        plan = self._plan
        if plan is None or not plan.fits(meta, key):
            plan = plan_attention(meta, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], q.device)
            self._plan = plan
        return plan

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
        # GEMM tiles where this CPU's BLAS passed their probes, the canonical GEMMs one by one elsewhere:
        # one definition of a token's bits either way (kernels/reference/tiled_attention.py).
        return tiled_paged_attention(q, k_cache, v_cache, meta, scale,
                                     plan=self._attention_plan(q, k_cache, meta))

    def attention_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
        return tiled_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                     plan=self._attention_plan(q, k_cache, meta))


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
