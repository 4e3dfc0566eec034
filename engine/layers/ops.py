"""The numeric-ops interface the models call (backends.make_ops picks an implementation for a device).

Every backend implements the same methods. With `deterministic=True` each op is batch-invariant: a row's
result is bitwise the same whatever other rows share the call, how a prompt was split into prefill chunks
and whether its prefix came from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.activation import pairs_to_halves
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.reference.fp8_matmul import fp8_linear_quantized_ref, fp8_linear_ref, quantize_act_ref
from deepinfer.kernels.reference.kv_fp8 import store_kv_fp8_ref
from deepinfer.kernels.reference.mla import chunked_mla_attention, split_kv_b, store_mla_ref
from deepinfer.kernels.reference.rotary_store import rotate_half_ref
from deepinfer.kernels.reference.store_kv import store_kv_ref
from deepinfer.kernels.reference.v4_attention import KeySource, gather_keys, sink_attention
from deepinfer.kernels.reference.v4_indexer import indexer_scores_ref

if TYPE_CHECKING:   # kernels/matmul_split.py needs triton, which a CPU install does not have
    from deepinfer.kernels.matmul_split import SplitSum


@dataclass(frozen=True)
class QuantizedActivation:
    """Activation rows already quantized for an FP8 linear: what RMSNorm or SiLU-and-mul hands over instead
    of its output when the next linear is FP8, so that linear skips its own quantization pass.

    `group` 0: one scale per row (kernels/fp8_row_quant.py's `quantize_rows`; the rowwise GEMM of per-channel
    weights). `group` G > 0: one scale per token and K-group of G columns (kernels/fp8_matmul.py's
    `quantize_act(x, G)`; the block-scaled GEMM, whose weight K-group must be the same G)."""

    values: torch.Tensor  # e4m3 [M, K]: rtne(x / scale) clamped to +-448, x the rows it stands for
    scales: torch.Tensor  # float32 [M, 1] contiguous (group 0) or [M, ceil(K / group)]: max(amax, EPS) / 448
    dtype: torch.dtype    # dtype of the rows it stands for: the linear's output dtype
    group: int = 0        # columns per scale; 0: the whole row

    @property
    def shape(self) -> torch.Size:
        """[M, K], the shape of the rows it stands for (callers read the row count from it)."""
        return self.values.shape


def check_quantized_input(x: QuantizedActivation, weight_scale: torch.Tensor, group: int) -> None:
    """ValueError unless quantized rows fit an FP8 layer: per-row rows need one weight scale per output
    channel; per-group rows need the layer's K-group and its number of groups."""
    if x.group == 0:
        if weight_scale.shape[1] != 1:
            raise ValueError(f"fp8_linear: rows quantized per row need one weight scale per output channel, "
                             f"got weight_scale {tuple(weight_scale.shape)}")
    elif x.group != group or x.scales.shape != (x.shape[0], weight_scale.shape[1]):
        raise ValueError(f"fp8_linear: rows quantized per K-group of {x.group} (scales "
                         f"{tuple(x.scales.shape)}) do not fit a layer with K-group {group} and weight_scale "
                         f"{tuple(weight_scale.shape)}")


class Ops:
    """Base class: shared op implementations; backends override what they compute differently."""

    name = "base"
    deterministic = False
    # Whether the ops producing an FP8 linear's input (`add_rms_norm_quant`, `silu_and_mul_quant`) should
    # quantize it, per row (rowwise linears) or per K-group (block-scaled ones); layers ask
    # `Linear.takes_quantized_rows`. Off here: the linear quantizes its own input, with the same bits. CUDA
    # backends fuse the quantization into the producing kernel.
    fuses_fp8_row_quant = False
    # Whether an MLP's rowwise FP8 gate_up projection computes silu(gate) * up in its GEMM's epilogue
    # (`fp8_swiglu_linear`, its weight rows reordered at load by models/quant/fp8_loading.py). Off here.
    swiglu_in_gate_up = False
    # The same for a 16-bit gate_up projection (`swiglu_linear`): the deterministic CUDA backend's.
    swiglu_in_16bit_gate_up = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
        raise NotImplementedError

    def linear_into_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                         ) -> torch.Tensor | SplitSum:
        """`linear` for a projection whose output goes only into `add_rms_norm` (a pre-norm layer's attention
        output and MLP output): a backend may hand back what that op alone reads, with the same result
        (the invariant CUDA backend: a parallel split-K's partials, summed inside the norm's kernel). Shared
        version: `linear`."""
        return self.linear(x, weight, bias)

    def fp8_linear(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
                   weight_scale: torch.Tensor, bias: torch.Tensor | None, group: int,
                   scale_block_n: int = 0) -> torch.Tensor:
        """x [M, K] @ dequant(e4m3 weight [N, K], row scales [N, K/group])^T (+ bias), x quantized per
        token-group of `group` (or already: a QuantizedActivation, per row for weights with one scale per
        output channel, per K-group of `group` for block-scaled ones). `scale_block_n` > 0: the row scales
        are equal within aligned blocks of that many rows (a GEMM may read one per tile; same values).
        Shared version: the plain-torch reference (row-local, so batch-invariant); CUDA backends run the
        Triton FP8 GEMMs."""
        if isinstance(x, QuantizedActivation):
            check_quantized_input(x, weight_scale, group)
            k = x.shape[1] if x.group == 0 else group
            return fp8_linear_quantized_ref(x.values, x.scales, weight, weight_scale, bias, k, x.dtype)
        return fp8_linear_ref(x, weight, weight_scale, bias, group)

    def fp8_swiglu_linear(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
                          weight_scale: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [M, I] of an FP8 gate_up linear with one scale per output channel whose weight
        rows alternate gate j, up j (models/quant/fp8_tensor.interleave_gate_up). Shared version:
        `fp8_linear`, the column pairs taken apart, `silu_and_mul`; CUDA backends: the SwiGLU in the GEMM's
        epilogue, the same bits."""
        return self._swiglu_of_pairs(self.fp8_linear(x, weight, weight_scale, None, weight.shape[1]))

    def swiglu_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up [M, I] of a 16-bit gate_up linear whose weight (and bias) rows alternate gate j,
        up j (models/quant/fp8_tensor.interleave_halves). Shared version: `linear`, the column pairs taken
        apart, `silu_and_mul`; the deterministic CUDA backend: the SwiGLU in the GEMM's epilogue (kernels/
        matmul.bi_linear's `swiglu`), the same bits."""
        return self._swiglu_of_pairs(self.linear(x, weight, bias))

    def _swiglu_of_pairs(self, out: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(pairs_to_halves(out))

    def quantize_rows(self, x: torch.Tensor) -> QuantizedActivation:
        """x [M, K] quantized with one scale per row (the rowwise FP8 GEMM's activation format)."""
        q, s = quantize_act_ref(x, max(x.shape[1], 1))
        return QuantizedActivation(q, s, x.dtype)

    def quantize_groups(self, x: torch.Tensor, group: int) -> QuantizedActivation:
        """x [M, K] quantized with one scale per token and K-group (the block-scaled GEMM's format)."""
        q, s = quantize_act_ref(x, group)
        return QuantizedActivation(q, s, x.dtype, group)

    def quantize(self, x: torch.Tensor, group: int | None) -> QuantizedActivation:
        """x [M, K] quantized for an FP8 linear whose `Linear.quant_group` is `group`: `quantize_rows`
        (None) or `quantize_groups`."""
        return self.quantize_rows(x) if group is None else self.quantize_groups(x, group)

    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, group: int | None = None) -> tuple[QuantizedActivation, torch.Tensor]:
        """`add_rms_norm` with the normed rows quantized for an FP8 linear: per row (`group` None) or per
        token and K-group of `group`. Shared version: the unfused composition; CUDA backends: one kernel,
        the same bits."""
        out, summed = self.add_rms_norm(x, residual, weight, eps)
        return self.quantize(out, group), summed

    def silu_and_mul_quant(self, x: torch.Tensor, group: int | None = None) -> QuantizedActivation:
        """`silu_and_mul` with the result quantized for an FP8 linear (per row, or per K-group of
        `group`). Shared version: the unfused composition; CUDA backends: one kernel, the same bits."""
        return self.quantize(self.silu_and_mul(x), group)

    def routed_experts_fp8(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                           down_scale: torch.Tensor, group: int) -> torch.Tensor:
        """`routed_experts` with block-scaled e4m3 experts (row scales [E, N, K/group], models/quant/
        fp8_experts.py). Shared version: the plain reference (kernels/reference/fp8_moe.py); CUDA backends
        run the grouped FP8 GEMMs (kernels/fp8_moe.py)."""
        from deepinfer.kernels.reference.fp8_moe import fp8_moe_ref

        return fp8_moe_ref(x, ids, weights, gate_up, gate_up_scale, down, down_scale, group,
                           act=self.silu_and_mul)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Row-wise RMSNorm over the last dim of x [M, H]: float32 statistics as in transformers."""
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); residual None means x alone is the new residual."""
        summed = x if residual is None else residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, 2I] = [gate | up] -> silu(gate) * up [M, I]."""
        raise NotImplementedError

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at flat slots [T]."""
        store_kv_ref(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)

    def rotary_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of q [T, Hq, D] and k [T, Hkv, D] (rotate_half convention, cos/sin [T, 1, D] in
        the activation dtype), then `store_kv` of the rotated k and v; returns the rotated q.

        Shared version: the unfused composition (rotate q, rotate k, `self.store_kv`). CUDA backends run
        one fused kernel with the same bits (kernels/rotary_store.py).
        """
        q, k = rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def store_kv_fp8(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """`store_kv` into e4m3 caches, each kv head divided by its float32 scale [Hkv] first."""
        store_kv_fp8_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rotary_store_kv_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                            v_scale: torch.Tensor) -> torch.Tensor:
        """`rotary_store_kv` into e4m3 caches: q and k rotated in the activation dtype, then `store_kv_fp8`
        of the rotated k and v with the per-kv-head scales; returns the rotated q.

        Shared version: the unfused composition. CUDA backends run one fused kernel with the same bits
        (kernels/rotary_store.py, KV_FP8).
        """
        q, k = rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)
        self.store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q

    def attention_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
        """`attention` over e4m3 caches with per-kv-head scales. Shared version: the plain reference."""
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal paged attention: q [T, Hq, D] -> [T, Hq, D].

        The query token at absolute position p attends to positions [0, p] of its own sequence, all read
        from the cache (after `store_kv` wrote this step's k/v). Hq is a multiple of Hkv (GQA).
        """
        raise NotImplementedError

    def store_mla(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """Write MLA's latent [T, R] and rope key [T, P] into the latent cache [blocks, block_size, R + P]."""
        store_mla_ref(latent, k_pe, cache, slot_mapping)

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      meta: AttentionMetadata, kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal MLA over the latent cache: q_nope [T, H, N], q_pe [T, H, P] -> [T, H, V].

        Shared version, every token in the absorbed form (q_nope into latent space with W_UK, attention
        over the cached entries, out through W_UV; see kernels/reference/mla.py). In deterministic mode the
        per-head projections run through `self.linear` (row-invariant) and the attention core reduces keys
        in fixed chunks, so prefill and decode rows take one path and a token's bits never depend on how it
        was scheduled; otherwise the projections are plain einsums.
        """
        num_heads, nope = q_nope.shape[1], q_nope.shape[2]
        rank = kv_b_weight.shape[1]
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope)          # [H, N, R], [H, V, R]
        if self.deterministic:
            # linear(x, W) = x @ W^T: W_UK[h]^T is [R, N]; W_UV[h] is already [V, R]. Contiguous operands,
            # as the GPU's invariant matmul requires.
            q_lat = torch.stack([self.linear(q_nope[:, h].contiguous(), w_uk[h].t().contiguous())
                                 for h in range(num_heads)], dim=1)
        else:
            q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_abs = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        o_lat = chunked_mla_attention(q_abs, cache, meta, scale, rank)  # [T, H, R]
        if self.deterministic:
            return torch.stack([self.linear(o_lat[:, h].contiguous(), w_uv[h].contiguous())
                                for h in range(num_heads)], dim=1)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def sum_last_in_order(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the last dim, left to right, one term at a time (the invariant MoE routers' row sums).
        Shared version: one torch add per term (kernels/reference/moe.py); CUDA backends: one kernel with
        the same bits (kernels/row_sum.py)."""
        from deepinfer.kernels.reference.moe import sum_last_in_order

        return sum_last_in_order(x)

    def routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor,
                       swiglu_limit: float | None = None) -> torch.Tensor:
        """Routed MoE: x [T, H], ids/weights [T, K] (slots sorted by expert id), gate_up [E, 2I, H],
        down [E, H, I] -> sum_k weights[:, k] * expert_ids[:, k](x), [T, H] in x's dtype. `swiglu_limit`
        (DeepSeek-V4): clipped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit).

        Shared version: each expert's rows through `self.linear` / `self.silu_and_mul` (row-invariant in
        deterministic backends; the clamp first, kernels/reference/fused_moe.py's clip_gate_up), slots
        summed term by term in slot order (kernels/reference/moe.py).
        """
        from deepinfer.kernels.reference.fused_moe import clip_gate_up
        from deepinfer.kernels.reference.moe import combine_experts, experts_ref

        act = self.silu_and_mul
        if swiglu_limit is not None:
            def act(h: torch.Tensor) -> torch.Tensor:
                return self.silu_and_mul(clip_gate_up(h, swiglu_limit))
        out = experts_ref(x, ids, gate_up, down, linear=self.linear, act=act)
        return combine_experts(out, weights)

    # Whether `v4_sink_attention` / `v4_indexer_scores` gather the keys [T, L, D] (and, deterministic,
    # products [T, H, L, D]) first: the caller then bounds how many tokens one call covers.
    v4_gathers_keys = True

    def v4_sink_attention(self, q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """DeepSeek-V4's attention: q [T, H, D] -> [T, H, D] in q's dtype. Token t attends to the valid
        rows of each (rows [S, D], slots [T, L] int64, valid [T, L] bool) source in order (K = V), with a
        per-head sink logit sinks [H] (float32) in the softmax denominator.

        Shared version: gather the rows, then the plain-torch math (kernels/reference/v4_attention.py;
        elementwise products and halving sums in deterministic mode). CUDA backends read the slots directly
        in one Triton kernel (kernels/v4_attention.py)."""
        keys, valid = gather_keys(sources)
        return sink_attention(q, keys, valid, sinks, scale, self.deterministic).to(q.dtype)

    def v4_indexer_scores(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                          slots: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
        """DeepSeek-V4's Lightning Indexer: total [T, C] float32 = sum_h weights[t, h] * relu(q[t, h] .
        rows[slots[t, c]]) * scale, -inf where not valid[t, c]. q [T, H, dim], weights [T, H] float32.

        Shared version: gather, then the plain-torch math (kernels/reference/v4_indexer.py; elementwise
        products in deterministic mode). CUDA backends: one Triton kernel over the slots."""
        return indexer_scores_ref(q, weights, rows, slots, valid, scale, self.deterministic)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(deterministic={self.deterministic})"
