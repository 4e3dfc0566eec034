"""DeepSeek-V2/V3 hyper-parameters: multi-head latent attention (MLA), routed MoE, YaRN rope.

`DeepseekConfig` is a `ModelConfig` (so the engine's generic code reads vocab, eos ids, dtype, lengths as
for any model) plus three frozen parts, each validated when built: `MLAConfig`, `MoEConfig` and an optional
`YarnScaling`. Field names and defaults follow transformers' DeepseekV2Config / DeepseekV3Config, which is
what the parity tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.models.config import DEFAULT_ROPE_THETA, ModelConfig, _eos_ids, _Fields

DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_ARCHITECTURES = (DEEPSEEK_V2, DEEPSEEK_V3)
# How each architecture picks experts (transformers hard-codes it per class; config fields do not change it
# for V3, and V2 reads `topk_method`).
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as transformers' `_compute_yarn_parameters` reads it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"yarn rope: factor={self.factor!r} must be > 0")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"yarn rope: original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} must be >= 1")
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(f"yarn rope: beta_fast={self.beta_fast}, beta_slow={self.beta_slow} must be > 0")

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos/sin are multiplied by (transformers' `attention_factor`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor,
                                                                                     self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's correction of the softmax scale: mscale(factor, mscale_all_dim) squared, else 1."""
        if not self.mscale_all_dim:
            return 1.0
        m = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention shapes. The KV cache holds kv_lora_rank + qk_rope_head_dim per token."""

    num_heads: int
    q_lora_rank: int | None        # None: one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int              # the compressed latent each token caches (after kv_a_layernorm)
    qk_nope_head_dim: int          # per-head query/key part without rope (keys decompressed from the latent)
    qk_rope_head_dim: int          # rope part: per head for queries, one shared key per token
    v_head_dim: int
    rope_interleave: bool          # rope over (x0, x1), (x2, x3) pairs instead of the two halves
    attention_bias: bool           # bias on q_a_proj, kv_a_proj_with_mqa and o_proj

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim={self.qk_rope_head_dim} must be even for rope")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent then the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with shared experts; `topk_method` says how experts are chosen.

    noaux_tc (V3): sigmoid scores, + e_score_correction_bias for the choice only, groups ranked by the sum of
    their two best scores, top `topk_group` groups kept. greedy / group_limited_greedy (V2): softmax scores,
    groups ranked by their best score. Weights: optionally normalised (V3 only, as in transformers), then
    times routed_scaling_factor.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    topk_method: str
    n_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int     # layers [0, k) use a dense MLP, the rest MoE

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive(name, getattr(self, name))
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config.json field {name}={value!r}: must be an integer >= 0")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config.json: topk_method={self.topk_method!r} is not supported; "
                             f"use one of {TOPK_METHODS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"n_routed_experts={self.n_routed_experts}")
        if self.topk_method == "greedy":
            return
        if self.n_group is None or self.topk_group is None:
            raise ValueError(f"config.json: topk_method={self.topk_method!r} needs n_group and topk_group")
        _positive("n_group", self.n_group)
        _positive("topk_group", self.topk_group)
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"config.json: n_routed_experts={self.n_routed_experts} must be a multiple of "
                             f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"config.json: topk_group={self.topk_group} exceeds n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(f"config.json: noaux_tc routing ranks groups by their two best experts, so "
                             f"n_routed_experts / n_group must be >= 2 (got {per_group}); lower n_group")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                             f"{self.topk_group * per_group} experts of the topk_group={self.topk_group} "
                             "kept groups; raise topk_group")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig(ModelConfig):
    """A ModelConfig with the MLA, MoE and rope parts of a DeepSeek-V2/V3 checkpoint.

    The inherited fields keep transformers' meaning for these models: head_dim is qk_rope_head_dim and
    num_key_value_heads equals num_attention_heads; rope_scaling is None (YaRN lives in `yarn`).
    """

    mla: MLAConfig
    moe: MoEConfig
    yarn: YarnScaling | None = None
    num_mtp_layers: int = 0        # MTP layers stored after the decoder layers (1st: the MTP draft)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"config.json: num_key_value_heads={self.num_key_value_heads} must equal "
                             f"num_attention_heads={self.num_attention_heads} for MLA (every head "
                             "decompresses its own keys from the shared latent)")
        if self.mla.num_heads != self.num_attention_heads:
            raise ValueError("MLAConfig.num_heads must equal num_attention_heads")
        if self.num_mtp_layers < 0:
            raise ValueError(f"config.json: num_nextn_predict_layers={self.num_mtp_layers} must be >= 0")

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale correction when the rope is scaled."""
        scale = self.mla.qk_head_dim ** -0.5
        return scale * self.yarn.softmax_scale_factor if self.yarn is not None else scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  source: str = "config.json") -> DeepseekConfig:
        """Build from parsed config.json contents (transformers 4.x or 5.x layout, or DeepSeek's own)."""
        gen = generation or {}
        f = _Fields(raw, source)
        arch = raw["architectures"][0]
        is_v3 = arch == DEEPSEEK_V3
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: field 'hidden_act'={act!r} is not supported (only 'silu')")
        heads = f.int("num_attention_heads")
        q_lora = raw.get("q_lora_rank")
        mla = MLAConfig(
            num_heads=heads,
            q_lora_rank=f.int("q_lora_rank") if q_lora is not None else None,
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=f.int("qk_rope_head_dim"),
            v_head_dim=f.int("v_head_dim"),
            # V2's rope is always over interleaved pairs (complex multiplication in transformers).
            rope_interleave=bool(raw.get("rope_interleave", True)) if is_v3 else True,
            attention_bias=bool(raw.get("attention_bias", False)),
        )
        method = "noaux_tc" if is_v3 else str(raw.get("topk_method") or "greedy")
        if not is_v3 and method == "noaux_tc":
            raise ValueError(f"{source}: topk_method='noaux_tc' is DeepSeek-V3 routing; the architecture "
                             f"is {arch} (use DeepseekV3ForCausalLM, or topk_method greedy or "
                             "group_limited_greedy)")
        moe = MoEConfig(
            n_routed_experts=f.int("n_routed_experts"),
            num_experts_per_tok=f.int("num_experts_per_tok"),
            n_shared_experts=f.int("n_shared_experts", default=0),
            moe_intermediate_size=f.int("moe_intermediate_size"),
            topk_method=method,
            n_group=raw.get("n_group"),
            topk_group=raw.get("topk_group"),
            routed_scaling_factor=f.float("routed_scaling_factor", default=2.5 if is_v3 else 1.0),
            # transformers' V2 router never normalises; V3's does when norm_topk_prob is set.
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if is_v3 else False,
            first_k_dense_replace=f.int("first_k_dense_replace", default=3 if is_v3 else 0),
        )
        max_pos = f.int("max_position_embeddings")
        theta, yarn = _parse_deepseek_rope(raw, max_pos, source)
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        mtp = raw.get("num_nextn_predict_layers", 1 if is_v3 else 0)
        return cls(
            architecture=arch,
            model_type=str(raw.get("model_type", "")),
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            num_hidden_layers=f.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=mla.qk_rope_head_dim,
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            rope_theta=theta,
            rope_scaling=None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=mla.attention_bias,
            o_proj_bias=mla.attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if not is_v3 else False,
            torch_dtype=str(dtype) if dtype is not None else None,
            eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id"), source),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            mla=mla,
            moe=moe,
            yarn=yarn,
            num_mtp_layers=int(mtp or 0),
        )


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json field {name}={value!r}: must be a positive integer")


def _parse_deepseek_rope(raw: dict[str, Any], max_pos: int, source: str) -> tuple[float, YarnScaling | None]:
    """(theta, yarn or None) from `rope_parameters` (transformers 5.x) or `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    where = "rope_parameters"
    if not params:
        params, where = raw.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field '{where}' must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"{source}: rope_theta={theta!r} must be a number > 0")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: {where}.partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"{source}: {where}.rope_type={rope_type!r} is not supported for DeepSeek models "
                         "(supported: default, yarn)")
    try:
        original = int(params.get("original_max_position_embeddings", max_pos))
        factor = params["factor"]
        # transformers: a null factor means "stretched from the original length to max_position_embeddings".
        factor = float(factor) if factor is not None else max_pos / original
        optional = {k: (float(params[k]) if params.get(k) is not None else None)
                    for k in ("mscale", "mscale_all_dim", "attention_factor")}
        return float(theta), YarnScaling(
            factor=factor, original_max_position_embeddings=original,
            # transformers treats 0/None like unset: `beta_fast or 32`.
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)), **optional,
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ValueError) and "yarn rope" in str(e):
            raise
        raise ValueError(f"{source}: {where} of rope_type 'yarn' lacks or mistypes field {e}") from e
