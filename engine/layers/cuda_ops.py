"""CUDA ops backends over deepinfer's Triton kernels (imported only when a CUDA backend is built)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops, QuantizedActivation, check_quantized_input
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.v4_attention import KeySource

if TYPE_CHECKING:
    from deepinfer.kernels.matmul_split import SplitSum


def _kernels():
    """Import the Triton kernel modules; a clear error when they (or triton) are unavailable."""
    try:
        from deepinfer.kernels import activation, matmul, paged_attention, rmsnorm, rotary_store, store_kv
    except ImportError as e:
        raise RuntimeError(
            f"CUDA ops need deepinfer's Triton kernels (deepinfer.kernels) and triton: {e}"
        ) from e
    return matmul, rmsnorm, paged_attention, activation, store_kv, rotary_store


# Set to 1 to run rotary + KV store unfused (rotate q, rotate k, store_kv) on CUDA, e.g. to A/B the kernel.
DISABLE_FUSED_ROPE_ENV = "DEEPINFER_DISABLE_FUSED_ROPE"
# Set to 1 to let FP8 linears quantize their bf16 input themselves instead of RMSNorm / SiLU-and-mul handing
# them quantized rows (kernels/fp8_fused_quant.py per row, kernels/fp8_group_quant.py per K-group; the same
# bits either way), e.g. to A/B it.
DISABLE_FUSED_FP8_QUANT_ENV = "DEEPINFER_DISABLE_FUSED_FP8_QUANT"
# Set to 1 to keep an MLP's SwiGLU out of its gate_up GEMM's epilogue (Ops.swiglu_in_gate_up for rowwise FP8,
# Ops.swiglu_in_16bit_gate_up for the deterministic 16-bit GEMM): the GEMM then writes [gate | up] and
# SiLU-and-mul (or its fused quantizer) reads it back; the same bits.
DISABLE_SWIGLU_EPILOGUE_ENV = "DEEPINFER_DISABLE_SWIGLU_EPILOGUE"

# Set to 1 to reduce a parallel split-K's partials in their own kernel before the RMSNorm that follows the
# projection (Ops.linear_into_norm), instead of inside that norm's kernel; the same bits.
DISABLE_SPLIT_SUM_IN_NORM_ENV = "DEEPINFER_DISABLE_SPLIT_SUM_IN_NORM"
# Set to 1 to run the deterministic GEMM's persistent tile loops unflattened (MatmulConfig.flatten; the same
# bits), e.g. to A/B it.
DISABLE_GEMM_FLATTEN_ENV = "DEEPINFER_DISABLE_GEMM_FLATTEN"


class _CudaOps(Ops):
    """Triton norm, activation, KV store and paged attention; subclasses choose the matmul."""

    def __init__(self) -> None:
        (self._matmul, self._rmsnorm, self._attention, self._activation,
         self._store_kv, self._rotary_store) = _kernels()
        # Read once per backend (not per call), so one engine never mixes the two paths.
        self.fused_rope = os.environ.get(DISABLE_FUSED_ROPE_ENV, "").strip() != "1"
        self.fuses_fp8_row_quant = os.environ.get(DISABLE_FUSED_FP8_QUANT_ENV, "").strip() != "1"
        self._swiglu_epilogue = os.environ.get(DISABLE_SWIGLU_EPILOGUE_ENV, "").strip() != "1"
        self.swiglu_in_gate_up = self.fuses_fp8_row_quant and self._swiglu_epilogue
        # The rowwise and block-scaled FP8 GEMMs' M-bucket planners (kernels/fp8_rowwise.py,
        # kernels/fp8_block_plan.py); only the invariant backend has them (the fast mode picks tiles from M
        # freely).
        self._fp8_planner = None
        self._block_planner = None
        from deepinfer.kernels.fp8_block_plan import BLOCK_TABLE_ENV, load_block_table

        # The block GEMM's bucket table (a sweep's, from a file, or the shipped one), read once.
        self._block_table = load_block_table(os.environ.get(BLOCK_TABLE_ENV, "").strip() or None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor | SplitSum, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # x may be `linear_into_norm`'s split-K partials: the norm's kernel sums them (kernels/rmsnorm.py).
        if residual is None:
            x = self._summed(x)
            return self._rmsnorm.rms_norm(x, weight, eps), x
        return self._rmsnorm.rms_norm(x, weight, eps, residual=residual)

    def _summed(self, x: torch.Tensor | SplitSum) -> torch.Tensor:
        """x as a tensor: `linear_into_norm`'s split-K partials reduced (the GEMM's own result)."""
        return x.materialize() if isinstance(x, self._matmul.SplitSum) else x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._activation.silu_and_mul(x)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._store_kv.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def rotary_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        # The fused kernel covers caches in the activation dtype; anything else (switched off, a cache of
        # another dtype) takes the unfused composition: today's path, with the same bits.
        if not self.fused_rope or k_cache.dtype != q.dtype or cos.dtype != q.dtype:
            return super().rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return self._fused_rotary_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def _fused_rotary_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
        """The fused kernel for both cache forms (`scales`: an e4m3 cache's k_scale, v_scale): the layers'
        cos/sin [T, 1, D] rows as the [T, D] the kernel takes."""
        rows = cos.shape[0]
        return self._rotary_store.rotary_store_kv(q, k, v, cos.reshape(rows, -1), sin.reshape(rows, -1),
                                                  k_cache, v_cache, slot_mapping, *scales)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attention.paged_attention(q, k_cache, v_cache, meta, scale)

    def store_kv_fp8(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        from deepinfer.kernels.kv_fp8 import store_kv_fp8

        store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rotary_store_kv_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                            v_scale: torch.Tensor) -> torch.Tensor:
        # One launch for an e4m3 cache too (the kernel's KV_FP8 form); switched off: rotary, then the Triton
        # store_kv_fp8, with the same bits.
        if not self.fused_rope or cos.dtype != q.dtype:
            return super().rotary_store_kv_fp8(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                               k_scale, v_scale)
        return self._fused_rotary_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attention_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
        return self._attention.paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def store_mla(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        from deepinfer.kernels.store_mla import store_mla

        store_mla(latent, k_pe, cache, slot_mapping)

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
        # Absorbed form for every row (kernels/mla_decode.py): W_UK into latent space, the Triton MLA kernel
        # over the latent cache, W_UV out. Deterministic: the row-invariant per-head GEMM and the fixed
        # split-KV policy, so prefill, decode and any batch give a token the same bits; fast: cuBLAS and a
        # split chosen per step.
        from deepinfer.kernels import mla_decode as mk
        from deepinfer.kernels.reference.mla import split_kv_b

        num_tokens, num_heads, nope = q_nope.shape
        rope = q_pe.shape[2]
        rank = cache.shape[2] - rope
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope)          # [H, N, R], [H, V, R] views
        q_abs = torch.empty((num_tokens, num_heads, rank + rope), dtype=cache.dtype, device=cache.device)
        if self.deterministic:
            mk.head_proj(q_nope, w_uk.transpose(1, 2), out=q_abs[:, :, :rank])
            policy = mk.DETERMINISTIC_SPLITS
        else:
            q_abs[:, :, :rank] = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            policy = mk.fast_split_policy(meta, num_heads, cache.device)
        q_abs[:, :, rank:] = q_pe
        o_lat = mk.mla_decode(q_abs, cache, meta, scale, rank, policy=policy)
        if self.deterministic:
            return mk.head_proj(o_lat, w_uv)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor,
                       swiglu_limit: float | None = None) -> torch.Tensor:
        # kernels/fused_moe.py: expert-sorted grouped GEMMs, combined per token in slot order without
        # atomics; fixed tiles when deterministic, small-batch tiles allowed in fast mode. The clipped
        # SwiGLU (V4) is a constexpr variant of the gate_up kernel, clamping its fp32 accumulators.
        from deepinfer.kernels.fused_moe import fused_moe

        return fused_moe(x.contiguous(), ids.contiguous(), weights.to(torch.float32).contiguous(),
                         gate_up, down, invariant=self.deterministic, swiglu_limit=swiglu_limit)

    def fp8_linear(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
                   weight_scale: torch.Tensor, bias: torch.Tensor | None, group: int,
                   scale_block_n: int = 0) -> torch.Tensor:
        # FP8 GEMMs, batch-invariant tiles (proven M buckets) in deterministic mode. One K-group spanning K
        # (per-channel / per-tensor weights): the rowwise kernel, scales applied once after the K loop
        # (kernels/fp8_rowwise.py); else the block-scaled kernel (kernels/fp8_block_plan.py). Either on
        # rows the producing op may have quantized already.
        from deepinfer.kernels import fp8_block_plan as bp

        if isinstance(x, QuantizedActivation):
            check_quantized_input(x, weight_scale, group)
            if x.group == 0:
                from deepinfer.kernels.fp8_rowwise import fp8_rowwise_linear_quantized

                return fp8_rowwise_linear_quantized(x.values, x.scales, weight, weight_scale, bias,
                                                    out_dtype=x.dtype, invariant=self.deterministic,
                                                    planner=self._fp8_planner)
            return bp.block_linear_quantized(x.values, x.scales, weight, weight_scale, bias,
                                             out_dtype=x.dtype, group=group, invariant=self.deterministic,
                                             planner=self._block_planner, scale_block_n=scale_block_n,
                                             table=self._block_table)
        if group >= x.shape[1] and weight_scale.shape[1] == 1:
            from deepinfer.kernels.fp8_rowwise import fp8_rowwise_linear

            return fp8_rowwise_linear(x.contiguous(), weight, weight_scale, bias,
                                      invariant=self.deterministic, planner=self._fp8_planner)
        return bp.block_linear(x.contiguous(), weight, weight_scale, bias, group=group,
                               invariant=self.deterministic, planner=self._block_planner,
                               scale_block_n=scale_block_n, table=self._block_table)

    def fp8_swiglu_linear(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
                          weight_scale: torch.Tensor) -> torch.Tensor:
        from deepinfer.kernels.fp8_rowwise import fp8_rowwise_swiglu_quantized

        q = x if isinstance(x, QuantizedActivation) else self.quantize_rows(x)
        check_quantized_input(q, weight_scale, weight.shape[1])
        if q.group:
            raise ValueError("fp8_swiglu_linear: rows quantized per K-group; the rowwise GEMM takes per-row")
        return fp8_rowwise_swiglu_quantized(q.values, q.scales, weight, weight_scale, out_dtype=q.dtype,
                                            invariant=self.deterministic, planner=self._fp8_planner)

    def quantize_rows(self, x: torch.Tensor) -> QuantizedActivation:
        from deepinfer.kernels.fp8_row_quant import quantize_rows

        return QuantizedActivation(*quantize_rows(x.contiguous()), x.dtype)

    def quantize_groups(self, x: torch.Tensor, group: int) -> QuantizedActivation:
        from deepinfer.kernels.fp8_matmul import quantize_act

        return QuantizedActivation(*quantize_act(x.contiguous(), group), x.dtype, group)

    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, group: int | None = None) -> tuple[QuantizedActivation, torch.Tensor]:
        # One kernel: residual add, RMSNorm, the max of the rounded output per row (kernels/
        # fp8_fused_quant.py) or per K-group (kernels/fp8_group_quant.py), e4m3 cast; bitwise rms_norm then
        # quantize_rows / quantize_act.
        x = self._summed(x)
        if group is None:
            from deepinfer.kernels.fp8_fused_quant import rms_norm_quant

            q, s, summed = rms_norm_quant(x, weight, eps, residual=residual)
        else:
            from deepinfer.kernels.fp8_group_quant import rms_norm_group_quant

            q, s, summed = rms_norm_group_quant(x, weight, eps, group, residual=residual)
        return QuantizedActivation(q, s, x.dtype, group or 0), (x if summed is None else summed)

    def silu_and_mul_quant(self, x: torch.Tensor, group: int | None = None) -> QuantizedActivation:
        if group is None:
            from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant

            return QuantizedActivation(*silu_and_mul_quant(x), x.dtype)
        from deepinfer.kernels.fp8_group_quant import silu_and_mul_group_quant

        return QuantizedActivation(*silu_and_mul_group_quant(x, group), x.dtype, group)

    def sum_last_in_order(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] == 0:
            return super().sum_last_in_order(x)
        from deepinfer.kernels.row_sum import row_sum_in_order

        return row_sum_in_order(x.contiguous())

    def routed_experts_fp8(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                           down_scale: torch.Tensor, group: int) -> torch.Tensor:
        # kernels/fp8_moe.py: tokens quantized once, grouped FP8 GEMMs, combine in slot order.
        from deepinfer.kernels.fp8_moe import fp8_fused_moe

        return fp8_fused_moe(x.contiguous(), ids.contiguous(), weights.to(torch.float32).contiguous(),
                             gate_up, gate_up_scale, down, down_scale, group=group,
                             invariant=self.deterministic)

    # kernels/v4_attention.py and v4_indexer.py read the keys by slot: nothing [T, L, D]-sized is gathered.
    v4_gathers_keys = False

    def v4_sink_attention(self, q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor,
                          scale: float) -> torch.Tensor:
        # One kernel for both modes: batch-invariant by construction and faster than the gathered einsum.
        # A cache in another dtype than q (not a layout the model builds) takes the shared reference path.
        if any(rows.dtype != q.dtype for rows, _, _ in sources):
            return super().v4_sink_attention(q, sources, sinks, scale)
        from deepinfer.kernels.v4_attention import v4_sink_attention

        return v4_sink_attention(q.contiguous(), sources, sinks.to(torch.float32).contiguous(), scale)

    def v4_indexer_scores(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                          slots: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
        if rows.dtype != q.dtype:
            return super().v4_indexer_scores(q, weights, rows, slots, valid, scale)
        from deepinfer.kernels.v4_indexer import indexer_scores

        return indexer_scores(q, weights.to(torch.float32), rows, slots, valid, scale)


class CudaInvariantOps(_CudaOps):
    """Every op a batch-invariant Triton kernel (fixed tiling that never depends on the batch)."""

    name = "cuda-invariant"
    deterministic = True

    def __init__(self) -> None:
        super().__init__()
        # Decode-sized tile configs where the device proves them bitwise equal (kernels/matmul.py).
        self._planner = self._matmul.MatmulPlanner(
            flatten=os.environ.get(DISABLE_GEMM_FLATTEN_ENV, "").strip() != "1")
        self.swiglu_in_16bit_gate_up = self._swiglu_epilogue
        self._sum_in_norm = os.environ.get(DISABLE_SPLIT_SUM_IN_NORM_ENV, "").strip() != "1"
        from deepinfer.kernels.fp8_block_plan import BlockPlanner
        from deepinfer.kernels.fp8_rowwise import RowwisePlanner

        # The same for the FP8 GEMMs (BLOCK_K = 128 buckets), proven per weight shape likewise: the rowwise
        # one against its single config, the block-scaled one against today's single config.
        self._fp8_planner = RowwisePlanner()
        self._block_planner = BlockPlanner(self._block_table)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul.bi_linear(x, weight, bias, planner=self._planner)

    def swiglu_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul.bi_linear(x, weight, bias, planner=self._planner, swiglu=True)

    def linear_into_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                         ) -> torch.Tensor | SplitSum:
        # A parallel split-K (the decode buckets of a long-K, narrow weight: Qwen2.5-0.5B's down projection)
        # hands its partials to the norm, which sums them in the reduce's order: one launch less per layer.
        return self._matmul.bi_linear(x, weight, bias, planner=self._planner, defer_sum=self._sum_in_norm)


class CudaFastOps(_CudaOps):
    """cuBLAS matmuls (fastest, not batch-invariant) with the Triton attention and norm kernels."""

    name = "cuda-fast"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
