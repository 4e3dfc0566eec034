"""Measured engine throughput per model shape: what `deepinfer-job plan` turns token counts into hours with.

Only measured figures belong here (DESIGN.md: performance is claimed from benchmark runs only). A shape is
the model's config.json dimensions below, so any checkpoint of that architecture and size matches,
whatever its weights. `counts` says which tokens the rate counts: "total" (prompt + generated, the
throughput benchmarks' total tok/s) or "output" (generated tokens only).
"""

from __future__ import annotations

from typing import Any

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size")

RATES: tuple[dict[str, Any], ...] = (
    {
        "name": "Llama-3.1-8B",
        "shape": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336},
        "hardware": "1x NVIDIA H200", "conditions": "bfloat16, deterministic mode",
        "tokens_per_s": 41_368, "counts": "total", "measured": "2026-12-01",
    },
    {
        "name": "Qwen2.5-0.5B",
        "shape": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "intermediate_size": 4864},
        "hardware": "1x NVIDIA H200", "conditions": "",
        "tokens_per_s": 164_291, "counts": "total", "measured": "2026-12-01",
    },
    {
        "name": "demo",
        "shape": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 512},
        "hardware": "2-core CPU", "conditions": "approximate",
        "tokens_per_s": 75, "counts": "output", "measured": "2026-12-01",
    },
)


def model_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The shape of a model from its config.json (text_config for multimodal configs)."""
    source = config.get("text_config") if "hidden_size" not in config else config
    source = source or {}
    shape = {k: source.get(k) for k in SHAPE_KEYS}
    if shape["num_key_value_heads"] is None:  # HF's default: as many KV heads as attention heads
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    return shape


def rates_for(shape: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured rates whose shape equals `shape` (empty when the shape was never measured)."""
    return [r for r in RATES if r["shape"] == shape]


def engine_hours(rate: dict[str, Any], prompt_tokens: int, output_tokens: int) -> float:
    """Engine-hours to process the tokens at `rate` (one engine; divide by engines for wall time)."""
    tokens = output_tokens if rate["counts"] == "output" else prompt_tokens + output_tokens
    return tokens / float(rate["tokens_per_s"]) / 3600.0
