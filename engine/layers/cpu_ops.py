"""CPU ops backends: batch-invariant pure torch (deterministic) and plain torch (fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.matmul import row_invariant_mm
from deepinfer.kernels.reference.mla import mla_attention_ref
from deepinfer.kernels.reference.pointwise import PIECE, VEC_TILE
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
from deepinfer.kernels.reference.sdpa_attention import SdpaPlan, plan_sdpa_attention, sdpa_paged_attention
from deepinfer.kernels.reference.store_kv import store_kv_ref
from deepinfer.kernels.reference.tiled_attention import (
    AttentionPlan,
    plan_attention,
    plan_key,
    tiled_paged_attention,
)

# Row counts for which CpuFastOps.linear runs row_invariant_mm (one 16-row call in its transposed,
# column-sliced form) instead of F.linear: the only range where it is faster (135M shape, MKL, a decode
# step's GEMMs: 12 rows 64 vs 78 ms, 16 rows 61 vs 80; 8 rows even, 20-24 rows 117 vs 88-91).
DECODE_CHUNK_ROWS = (9, 16)


class _CpuOps(Ops):
    """What both CPU backends share: attention, rotary + KV store and SiLU-and-mul, each already
    batch-invariant and the fastest form this file has (so fast mode is never slower than deterministic
    mode; the backends differ in their GEMMs and norms)."""

    def __init__(self) -> None:
        # The attention plan of the step being run: every layer of a step has the same metadata, so the
        # tiling and its index tensors are built once per step, not once per layer (checked by value).
        self._plan: SdpaPlan | None = None
        self._tiled_plan: AttentionPlan | None = None   # the FP8 cache's attention (tiled GEMMs)

    def _attention_plan(self, q: torch.Tensor, k_cache: torch.Tensor,
                        meta: AttentionMetadata) -> AttentionPlan:
        key = plan_key(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
        plan = self._tiled_plan
        if plan is None or not plan.fits(meta, key):
            plan = plan_attention(meta, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], q.device)
            self._tiled_plan = plan
        return plan

    def _sdpa_attention_plan(self, q: torch.Tensor, k_cache: torch.Tensor,
                             meta: AttentionMetadata) -> SdpaPlan:
        key = plan_key(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
        plan = self._plan
        if plan is None or not plan.fits(meta, key):
            plan = plan_sdpa_attention(meta, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                                       q.device)
            self._plan = plan
        return plan

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # silu_and_mul_ref(x, invariant=True) with one copy instead of three: the gate goes once into a
        # fresh buffer padded to whole SIMD blocks, silu runs in place over the same PIECE-sized pieces
        # (each on one thread, on the vectorised path), then the product. Same elements, same code path,
        # same bits (tests/engine/test_cpu_lean_ops.py).
        rows, inter = x.shape[0], x.shape[1] // 2
        n = rows * inter
        buf = x.new_empty(-(-n // VEC_TILE) * VEC_TILE)
        buf[n:].zero_()
        gate = buf[:n].view(rows, inter)
        gate.copy_(x[:, :inter])
        for i in range(0, buf.numel(), PIECE):
            F.silu(buf[i:i + PIECE], inplace=True)
        return gate.mul_(x[:, inter:])

    def rotary_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        # Ops.rotary_store_kv in fewer passes, the same bits: x * cos + rotate_half(x) * sin, where
        # rotate_half(x) * sin = [-x2 * s1, x1 * s2] = [x2, x1] * [-s1, s2] exactly (negation is exact and
        # rounding symmetric), and the store as one index_copy_ per cache when every slot is real.
        half = q.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        q, k = (_rotate(x, cos, signed_sin) for x in (q, k))
        if k_cache.dtype != k.dtype or bool((slot_mapping < 0).any()):
            store_kv_ref(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)
        else:
            slots = slot_mapping.to(torch.int64)
            k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
        return q

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # torch's fused SDPA kernel over each token's own key span, in batched calls where their probes
        # passed and the canonical call one by one elsewhere: one definition of a token's bits either way
        # (kernels/reference/sdpa_attention.py).
        return sdpa_paged_attention(q, k_cache, v_cache, meta, scale,
                                    plan=self._sdpa_attention_plan(q, k_cache, meta))

    def attention_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
        return tiled_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                     plan=self._attention_plan(q, k_cache, meta))


class CpuInvariantOps(_CpuOps):
    """Batch-invariant CPU ops: `f(x)[i]` is bitwise `f(x[i:i+1])[0]` for every op."""

    name = "cpu-invariant"
    deterministic = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _invariant_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps, invariant=True)


def _invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias), row-invariant: torch.mm on CPU may pick its kernel (and so a row's summation
    order) by M; row_invariant_mm gives row i the bits of torch.mm over a fixed 16-row chunk."""
    out = row_invariant_mm(x, weight)
    return out + bias if bias is not None else out


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + [x2, x1] * signed_sin (x [T, H, D]; the halves swapped by one flip of a [2, D/2] view)."""
    shape = x.shape
    swapped = x.unflatten(-1, (2, shape[-1] // 2)).flip(-2).reshape(shape)
    return (x * cos).add_(swapped.mul_(signed_sin))


class CpuFastOps(_CpuOps):
    """Plain torch CPU ops: BLAS GEMMs over the whole batch and the plain RMSNorm (not batch-invariant)."""

    name = "cpu-fast"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not DECODE_CHUNK_ROWS[0] <= x.shape[0] <= DECODE_CHUNK_ROWS[1]:
            return F.linear(x, weight, bias)
        # Decode batches of 9-16 rows: the 16-row transposed form streams the weights faster than MKL's
        # plain call (benchmarks/RESULTS.md, 2026-12-04 21:55).
        return _invariant_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps)

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
        # Not batch-invariant: prefill rows expand the latents to per-head K/V, decode rows absorb.
        return mla_attention_ref(q_nope, q_pe, cache, meta, kv_b_weight, scale)
