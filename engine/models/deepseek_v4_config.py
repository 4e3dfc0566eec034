"""DeepSeek-V4 hyper-parameters: sliding-window + compressed attention per layer type, mHC, hash/top-k MoE.

`DeepseekV4Config` is a `ModelConfig` (the engine's generic code reads vocab, eos ids, dtype and lengths as
for any model) plus V4's own fields, read from config.json as transformers' DeepseekV4Config writes it
(5.2x: `layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters` = {"main", "compress"}) or
in DeepSeek's legacy spelling (`compress_ratios`, `compress_rate_csa/hca`, `num_hash_layers`,
`qk_rope_head_dim`, flat `rope_scaling`). Defaults follow transformers' class, the parity reference.

The inherited `sliding_window` stays None: it means "exact only up to this context" for Mistral, while
V4's window (`window`) bounds one branch of an attention that is exact at any length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.engine.models.config import ModelConfig, _eos_ids, _Fields
from deepinfer.engine.models.deepseek_config import YarnScaling

DEEPSEEK_V4 = "DeepseekV4ForCausalLM"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Rope:
    """One rope kind ("main" for sliding-only layers, "compress" for CSA/HCA layers and compressors)."""

    theta: float
    rope_dim: int  # trailing channels of each head that rotate (interleaved pairs)
    yarn: YarnScaling | None = None

    @property
    def cos_sin_scale(self) -> float:
        return 1.0 if self.yarn is None else self.yarn.cos_sin_scale


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(ModelConfig):
    """ModelConfig + V4 fields. head_dim is the shared K=V head (512 in V4), num_key_value_heads is 1."""

    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # ((CSA, 4), (HCA, 128))
    window: int  # sliding-window branch: a query sees its own and window - 1 earlier keys
    q_lora_rank: int
    main_rope: V4Rope
    compress_rope: V4Rope
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    num_mtp_layers: int = 0
    # The MTP module's attention kind: DeepSeek's legacy `compress_ratios` lists one more entry per MTP
    # layer (0 in the released V4 configs); transformers' `layer_types` stops at num_hidden_layers.
    mtp_layer_type: str = SLIDING

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE)),
        ):
            if len(types) != n:
                raise ValueError(
                    f"config.json: {name} has {len(types)} entries; num_hidden_layers={n} needs one per layer"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"config.json: {name} entries {bad} are not supported; use {allowed}")
        for name in (
            "window",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "num_experts_per_tok",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json field {name}={value!r}: must be a positive integer")
        for kind, rate in self.compress_rates:
            if rate < 1:
                raise ValueError(f"config.json: compress_rates[{kind!r}]={rate} must be >= 1")
        if self.num_key_value_heads != 1:
            raise ValueError(
                f"config.json: num_key_value_heads={self.num_key_value_heads}; DeepSeek-V4's "
                "attention is shared-KV multi-query, set it to 1"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"config.json: num_attention_heads * head_dim must be a multiple of o_groups={self.o_groups}"
            )
        for rope in (self.main_rope, self.compress_rope):
            if rope.rope_dim % 2 or not 0 < rope.rope_dim <= min(self.head_dim, self.index_head_dim):
                raise ValueError(
                    f"config.json: the rotary part ({rope.rope_dim} = head_dim * "
                    "partial_rotary_factor) must be even and fit head_dim and index_head_dim"
                )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"config.json: scoring_func={self.scoring_func!r}; supported: {SCORING_FUNCS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.mtp_layer_type not in LAYER_TYPES:
            raise ValueError(
                f"config.json: the MTP layer's type {self.mtp_layer_type!r} is not one of {LAYER_TYPES}"
            )
        if self.num_mtp_layers < 0:
            raise ValueError(f"config.json: num_nextn_predict_layers={self.num_mtp_layers} must be >= 0")

    def rate(self, layer_type: str) -> int:
        """Compression rate of a compressed layer type (tokens per compressed entry)."""
        return dict(self.compress_rates)[layer_type]

    def rope_for(self, layer: int) -> V4Rope:
        """Sliding-only layers rotate with the main rope, CSA/HCA layers with their compressor's."""
        return self.main_rope if self.layer_types[layer] == SLIDING else self.compress_rope

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config.json"
    ) -> DeepseekV4Config:
        """Build from parsed config.json contents (transformers 5.2x layout or DeepSeek's legacy keys)."""
        gen = generation or {}
        f = _Fields(raw, source)
        n = f.int("num_hidden_layers", default=43)
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"]]
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{source}: compress_ratios entries must be 0, 4 or 128 ({e})") from e
        if layer_types is None:  # transformers' default: 2 x HCA, then CSA / HCA interleaved
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
        for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if raw.get(key) is not None:
                rates[kind] = int(raw[key])
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        head_dim = f.int("head_dim", default=512)
        partial = raw.get("partial_rotary_factor")
        if partial is None:
            partial = raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") else 64 / 512
        main, compress = _parse_v4_rope(
            raw, head_dim, float(partial), f.int("max_position_embeddings", default=1048576), source
        )
        scoring = str(raw.get("scoring_func", "sqrtsoftplus"))
        if str(raw.get("hidden_act", "silu")) != "silu":
            raise ValueError(f"{source}: hidden_act={raw.get('hidden_act')!r} is not supported (only 'silu')")
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        moe_inter = f.int("moe_intermediate_size", default=2048)
        return cls(
            architecture=DEEPSEEK_V4,
            model_type=str(raw.get("model_type", "deepseek_v4")),
            vocab_size=f.int("vocab_size", default=129280),
            hidden_size=f.int("hidden_size", default=4096),
            intermediate_size=moe_inter,
            num_hidden_layers=n,
            num_attention_heads=f.int("num_attention_heads", default=64),
            num_key_value_heads=f.int("num_key_value_heads", default=1),
            head_dim=head_dim,
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            rope_theta=main.theta,
            rope_scaling=None,
            max_position_embeddings=f.int("max_position_embeddings", default=1048576),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=False,
            o_proj_bias=False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(dtype) if dtype is not None else None,
            eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id", 1), source),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id", 0)),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            compress_rates=((CSA, int(rates.get(CSA, 4))), (HCA, int(rates.get(HCA, 128)))),
            window=f.int("sliding_window", default=128),
            q_lora_rank=f.int("q_lora_rank", default=1024),
            main_rope=main,
            compress_rope=compress,
            o_groups=f.int("o_groups", default=8),
            o_lora_rank=f.int("o_lora_rank", default=1024),
            index_n_heads=f.int("index_n_heads", default=64),
            index_head_dim=f.int("index_head_dim", default=128),
            index_topk=f.int("index_topk", default=512),
            hc_mult=f.int("hc_mult", default=4),
            hc_sinkhorn_iters=f.int("hc_sinkhorn_iters", default=20),
            hc_eps=f.float("hc_eps", default=1e-6),
            n_routed_experts=f.int("n_routed_experts", default=256),
            num_experts_per_tok=f.int("num_experts_per_tok", default=6),
            n_shared_experts=f.int("n_shared_experts", default=1),
            scoring_func=scoring,
            routed_scaling_factor=f.float("routed_scaling_factor", default=1.5),
            swiglu_limit=f.float("swiglu_limit", default=10.0),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", 1) or 0),
            mtp_layer_type=layer_types[n] if len(layer_types) > n else SLIDING,
        )


def _parse_v4_rope(
    raw: dict[str, Any], head_dim: int, partial: float, max_pos: int, source: str
) -> tuple[V4Rope, V4Rope]:
    """(main, compress) ropes. YaRN applies to the compress rope only, with attention_factor 1 unless given
    (transformers' V4 config forces it: the reference does not scale cos/sin by YaRN's mscale)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters must be an object, got {params!r}")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_p, comp_p = params["main"], params["compress"]
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main_p = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        comp_p = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
    ropes = []
    for label, p in (("main", main_p), ("compress", comp_p)):
        theta = float(
            p.get(
                "rope_theta",
                raw.get(
                    "rope_theta" if label == "main" else "compress_rope_theta",
                    10000.0 if label == "main" else 160000.0,
                ),
            )
        )
        dim = int(head_dim * float(p.get("partial_rotary_factor", partial)))
        rope_type = p.get("rope_type", p.get("type", "default"))
        yarn = None
        if rope_type == "yarn":
            try:
                original = int(p["original_max_position_embeddings"])
                factor = float(p["factor"]) if p.get("factor") is not None else max_pos / original
                att = p.get("attention_factor", 1.0 if label == "compress" else None)
                yarn = YarnScaling(
                    factor=factor,
                    original_max_position_embeddings=original,
                    beta_fast=float(p.get("beta_fast") or 32),
                    beta_slow=float(p.get("beta_slow") or 1),
                    mscale=float(p["mscale"]) if p.get("mscale") is not None else None,
                    mscale_all_dim=float(p["mscale_all_dim"])
                    if p.get("mscale_all_dim") is not None
                    else None,
                    attention_factor=float(att) if att is not None else None,
                    truncate=bool(p.get("truncate", True)),
                )
            except (KeyError, TypeError, ValueError) as e:
                if isinstance(e, ValueError) and "yarn rope" in str(e):
                    raise
                raise ValueError(
                    f"{source}: rope_parameters.{label} of rope_type 'yarn' lacks or mistypes field {e}"
                ) from e
        elif rope_type != "default":
            raise ValueError(
                f"{source}: rope_parameters.{label}.rope_type={rope_type!r} is not supported for "
                "DeepSeek-V4 (supported: default, yarn)"
            )
        ropes.append(V4Rope(theta=theta, rope_dim=dim, yarn=yarn))
    return ropes[0], ropes[1]
