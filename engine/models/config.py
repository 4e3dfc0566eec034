"""The model's architecture hyper-parameters, read from a Hugging Face checkpoint directory.

Handles both config layouts transformers writes: 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and
5.x (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling fields; `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Parsed by deepseek_config.DeepseekConfig (a ModelConfig subclass); ModelConfig.from_dict returns one.
_DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3` uses all fields; `linear` only `factor`."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES[1:]:
            raise ValueError(f"rope_type={self.rope_type!r}: supported scalings: {SUPPORTED_ROPE_TYPES[1:]}")
        if self.factor <= 0:
            raise ValueError(f"rope factor={self.factor}: must be > 0")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope: high_freq_factor={self.high_freq_factor} must be > "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters (validated when built)."""

    architecture: str                 # e.g. "LlamaForCausalLM" (first entry of config.json `architectures`)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # bias on q/k/v projections (always True for Qwen2)
    o_proj_bias: bool                 # bias on the attention output projection (Llama's attention_bias)
    mlp_bias: bool
    torch_dtype: str | None           # checkpoint dtype name ("bfloat16", ...) or None when not recorded
    eos_token_ids: tuple[int, ...]    # generation_config.json ids first, then config.json's
    bos_token_id: int | None
    sliding_window: int | None = None  # Mistral: attention is exact only for contexts <= this

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json field {name}={value!r}: must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config.json field rms_norm_eps={self.rms_norm_eps!r}: must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"config.json rope_theta={self.rope_theta!r}: must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ `generation_config.json` for eos ids).

        ValueError naming the file and the field when something is missing or invalid.
        """
        path = Path(path)
        config_file = path / "config.json"
        raw = _read_json(config_file, required=True)
        gen = _read_json(path / "generation_config.json", required=False) or {}
        return cls.from_dict(raw, gen, source=str(config_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  source: str = "config.json") -> ModelConfig:
        """Build from already-parsed config.json (and generation_config.json) contents."""
        gen = generation or {}
        fields = _Fields(raw, source)
        archs = raw.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ValueError(f"{source}: field 'architectures' must be a non-empty list of class names, "
                             f"got {archs!r}")
        if archs[0] in _DEEPSEEK_ARCHITECTURES:
            # MLA + MoE checkpoints carry their own fields; imported here: that module builds on this one.
            from deepinfer.engine.models.deepseek_config import DeepseekConfig

            return DeepseekConfig.from_dict(raw, gen, source)
        if archs[0] == "DeepseekV4ForCausalLM":
            from deepinfer.engine.models.deepseek_v4_config import DeepseekV4Config

            return DeepseekV4Config.from_dict(raw, gen, source)
        model_type = str(raw.get("model_type", ""))
        hidden = fields.int("hidden_size")
        heads = fields.int("num_attention_heads")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads="
                                 f"{heads} and no head_dim is given")
            head_dim = hidden // heads
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: field 'hidden_act'={act!r} is not supported (only 'silu')")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
        theta, scaling = _parse_rope(raw, source)
        is_qwen2 = archs[0] == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        sliding = raw.get("sliding_window") if model_type == "mistral" else None
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=fields.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.int("intermediate_size"),
            num_hidden_layers=fields.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=fields.int("num_key_value_heads", default=heads),
            head_dim=head_dim,
            rms_norm_eps=fields.float("rms_norm_eps", default=1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=fields.int("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(dtype) if dtype is not None else None,
            eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id"), source),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            sliding_window=int(sliding) if sliding is not None else None,
        )


class _Fields:
    """Typed field access with errors that name the file and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise ValueError(f"{self.source}: required field '{name}' is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.source}: field '{name}'={value!r} must be an integer")
        return value

    def float(self, name: str, default: float | None = None) -> float:
        value = self.raw.get(name, default)
        if value is None:
            raise ValueError(f"{self.source}: required field '{name}' is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.source}: field '{name}'={value!r} must be a number")
        return float(value)


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: not found (a model directory needs a Hugging Face config.json)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Return (theta, scaling) from either `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x)."""
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type rope (e.g. {"full_attention": {...}}): these models use one kind for every layer.
        kinds = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(kinds) != 1:
            raise ValueError(f"{source}: per-layer-type rope_parameters differ; not supported")
        params = next(iter(params.values()))
    if not params:
        params = raw.get("rope_scaling") or {}
        field = "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field '{field}' must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{source}: rope_theta={theta!r} must be a number")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: {field}.partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: {field}.rope_type={rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    try:
        if rope_type == "linear":
            return float(theta), RopeScaling("linear", factor=float(params["factor"]))
        return float(theta), RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
            ),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: {field} of rope_type {rope_type!r} lacks or mistypes field {e}") from e


def _as_id_list(value: Any, name: str, source: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{source}: {name}={value!r} must be an int or a list of ints")
    return list(items)


def _eos_ids(gen_value: Any, cfg_value: Any, source: str) -> tuple[int, ...]:
    ids = _as_id_list(gen_value, "generation_config eos_token_id", source)
    for i in _as_id_list(cfg_value, "eos_token_id", source):
        if i not in ids:
            ids.append(i)
    return tuple(ids)
