"""Tiny random-weight checkpoints of real architectures, built with transformers' own classes.

Shared by every test that needs a model: `make_tiny_checkpoint(arch, path)` writes a complete Hugging
Face model directory (config.json, model.safetensors, generation_config.json, tokenizer files).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from deepinfer.engine.models.demo import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    PAD_TOKEN,
    write_tokenizer_files,
)

TINY_ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")
# Weights std: larger than HF's 0.02 so logits are spread out and greedy picks are far from ties.
WEIGHT_STD = 0.1

_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _hf_model(arch: str, vocab_size: int, bos: int, eos: int, pad: int):
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    common = dict(_SHAPE, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        return tf.LlamaForCausalLM(cfg)
    if arch == "llama3_rope":
        # original_max_position_embeddings 64 puts the head_dim-16 frequencies in all three llama3 bands.
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=scaling)
        return tf.LlamaForCausalLM(cfg)
    if arch == "mistral":
        cfg = tf.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None, rope_theta=10000.0)
        return tf.MistralForCausalLM(cfg)
    if arch == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        return tf.Qwen2ForCausalLM(cfg)
    if arch == "qwen3":
        cfg = tf.Qwen3Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        return tf.Qwen3ForCausalLM(cfg)
    raise ValueError(f"arch={arch!r}: expected one of {TINY_ARCHS}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded random values for every parameter, biases and norm weights included (HF zeroes/ones them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def make_tiny_checkpoint(arch: str, path: str | Path, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write a tiny random-weight HF checkpoint of `arch` (see TINY_ARCHS) into `path`; return the path.

    hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, intermediate 128, max positions 512; vocab of the
    demo BPE tokenizer, whose files are written too. Same (arch, seed, dtype) -> same weights.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer_files(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos, eos, im_end, pad = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN))
    torch.manual_seed(seed)  # HF's own init draws from the global generator; every value is replaced below
    model = _hf_model(arch, vocab_size, bos, eos, pad)
    _randomize(model, seed)
    model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n", encoding="utf-8")
    return path
