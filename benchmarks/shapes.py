"""Model shapes the GPU benchmarks run with random weights (config.json only, `load_format="dummy"`).

The model directories carry deepinfer's demo tokenizer (a small byte-level BPE), so bos/eos ids are the
demo tokenizer's (0 and 1); prompts are random token ids over the model's full vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None, "max_window_layers": 21,
    },
}

PARAMS = {"llama-3.1-8b": 8.03e9, "qwen2.5-0.5b": 0.494e9}


def write_shape(name: str, root: Path) -> Path:
    """A model dir holding the shape's config.json and the demo tokenizer (weights come from `dummy`)."""
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SHAPES[name], indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": SHAPES[name]["eos_token_id"]}))
    write_tokenizer_files(d)
    return d
