"""Architecture registry: config.json `architectures` name -> model built on the target device."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.decoder import ArchSpec, CausalLM
from deepinfer.engine.models.deepseek import DeepseekForCausalLM
from deepinfer.engine.models.deepseek_config import DEEPSEEK_ARCHITECTURES, DeepseekConfig
from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.engine.models.deepseek_v4_config import DEEPSEEK_V4, DeepseekV4Config

# Llama-family decoders share one implementation; the differences live in ArchSpec and ModelConfig
# (qkv bias: ModelConfig.attention_bias, forced on for Qwen2; rope scaling: ModelConfig.rope_scaling).
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted((*ARCHITECTURES, *DEEPSEEK_ARCHITECTURES, DEEPSEEK_V4)))


def arch_spec(architecture: str) -> ArchSpec:
    """The ArchSpec of a Llama-family architecture; ValueError listing the supported ones otherwise."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    return spec


def build_model(cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                max_model_len: int | None = None) -> CausalLM | DeepseekForCausalLM | DeepseekV4ForCausalLM:
    """Create the model for `cfg` with uninitialised parameters directly on `device` (no CPU copy).

    Fill it with `model.load_weights(...)` or `model.init_dummy_weights(seed)`. `max_model_len` bounds the
    rotary table (default: the config's max_position_embeddings). DeepSeek-V2/V3 (MLA + MoE) get their own
    module; every other architecture is the shared Llama-family decoder.
    """
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
    device = torch.device(device)
    if cfg.architecture == DEEPSEEK_V4:
        if not isinstance(cfg, DeepseekV4Config):
            raise ValueError(f"{cfg.architecture} needs a DeepseekV4Config (ModelConfig.from_dir builds one)")
        with torch.device(device):
            return DeepseekV4ForCausalLM(cfg, ops, dtype, device, max_positions=max_model_len).eval()
    if cfg.architecture in DEEPSEEK_ARCHITECTURES:
        if not isinstance(cfg, DeepseekConfig):
            raise ValueError(f"{cfg.architecture} needs a DeepseekConfig (ModelConfig.from_dir builds one)")
        with torch.device(device):
            return DeepseekForCausalLM(cfg, ops, dtype, device, max_positions=max_model_len).eval()
    spec = arch_spec(cfg.architecture)
    with torch.device(device):
        model = CausalLM(cfg, spec, ops, dtype, device, max_positions=max_model_len)
    return model.eval()
