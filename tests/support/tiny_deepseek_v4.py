"""Tiny random-weight DeepSeek-V4 checkpoints, built and saved with transformers' own classes (float32).

`make_tiny_deepseek_v4(path)` writes config.json, sharded safetensors with an index (transformers writes V4
in DeepSeek's own tensor names), generation_config.json, the demo tokenizer, and a fake MTP module
(`mtp.0.*`) in its own shard that the engine must keep aside. The shape exercises every V4 part on short
prompts: a window of 8, CSA every 4 tokens with an indexer keeping 3 entries, HCA every 8 tokens, all three
layer types, hash-routed then top-k routed MoE, 2 hyper-connection streams, YaRN on the compress rope.
transformers is imported lazily: on a machine whose transformers lacks V4, `hf_v4_available()` is False.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from deepinfer.engine.models.demo import BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN, write_tokenizer_files

from tests.support.tiny_deepseek import add_indexed_shard

WEIGHT_STD = 0.1
WINDOW = 8
TINY_V4: dict[str, Any] = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=24,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=2,
    hc_sinkhorn_iters=5,
    sliding_window=WINDOW,
    o_groups=2,
    o_lora_rank=16,
    # 8 indexer heads: an entry's score is an exact 0 (a tie) only when all 8 ReLUs are 0.
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    max_position_embeddings=1024,
    swiglu_limit=0.8,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)


def hf_v4_available() -> bool:
    try:
        import transformers as tf
    except ImportError:
        return False
    return hasattr(tf, "DeepseekV4Config")


def hf_config(vocab_size: int, bos: int, eos: int, pad: int, **overrides: Any) -> Any:
    import copy

    import transformers as tf

    fields = copy.deepcopy({**TINY_V4, **overrides})
    return tf.DeepseekV4Config(
        **fields,
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded values for every parameter, the router correction biases and hash tables (HF zeroes them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            is_norm = name.endswith("norm.weight") or name.endswith("layernorm.weight")
            p.copy_(
                1.0 + 0.1 * noise if is_norm else (noise if name.endswith("sinks") else WEIGHT_STD * noise)
            )
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                b.copy_(torch.rand(b.shape[0], experts, generator=gen).argsort(dim=1)[:, : b.shape[1]])


def _add_fake_mtp_shard(path: Path, cfg: Any, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = cfg.hidden_size
    shapes = {
        "mtp.0.enorm.weight": (hidden,),
        "mtp.0.hnorm.weight": (hidden,),
        "mtp.0.e_proj.weight": (hidden, hidden),
        "mtp.0.h_proj.weight": (hidden, hidden),
        "mtp.0.attn.wq_a.weight": (cfg.q_lora_rank, hidden),
        "mtp.0.norm.weight": (hidden,),
    }
    tensors = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    add_indexed_shard(path, "model-mtp.safetensors", tensors)
    return tensors


def write_v4_mtp_module(path: str | Path, seed: int = 0, agree: bool = False) -> Path:
    """Replace checkpoint `path`'s fake MTP shard by a complete MTP module `mtp.0.*` in DeepSeek's naming: a
    sliding-window block shaped like layer 0's attention (its type in TINY_V4) with a top-k MoE shaped like
    layer 2's, hyper-connections, enorm / hnorm / e_proj / h_proj, its own `norm` and `hc_head_*`.

    Random weights, or with `agree=True` a draft that always agrees with the target: every block of both
    gets zero output projections (attn.wo_b, the experts' and shared experts' w2), so the target's streams
    stay parallel to embed(t) and its logits are a fixed function of the current token; the MTP module takes
    only its embedding (e_proj = I, h_proj = 0, enorm = 1) and uses the target's final norm weight, so its
    logits for the token it is fed are the target's for that token. The LM head is scaled up (clear argmax).
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    weight_map = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    shards = {f: load_file(str(path / f)) for f in sorted(set(weight_map.values()))}
    main = {k: t for tensors in shards.values() for k, t in tensors.items()}
    zero = ("attn.wo_b.weight", ".w2.weight")
    if agree:
        for f, tensors in shards.items():
            for k in tensors:
                if k.endswith(zero):
                    tensors[k] = torch.zeros_like(tensors[k])
                elif k == "head.weight":
                    tensors[k] = tensors[k] * 20.0
            save_file(tensors, str(path / f), metadata={"format": "pt"})
    gen = torch.Generator().manual_seed(seed + 7)
    sources = {"model.layers.0.": ("attn", "attn_norm", "hc_"), "model.layers.2.": ("ffn", "ffn_norm")}
    mtp: dict[str, torch.Tensor] = {}
    for prefix, parts in sources.items():
        for name, t in main.items():
            rel = name.removeprefix(prefix)
            if name.startswith(prefix) and rel.startswith(parts):
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                if rel.endswith("norm.weight"):
                    value = 1.0 + 0.1 * noise
                elif rel.endswith(("attn_sink", "gate.bias")):
                    value = 0.1 * noise
                elif rel.startswith("hc_") and not rel.endswith("_fn"):
                    value = t.clone()
                else:
                    value = WEIGHT_STD * noise
                mtp[f"mtp.0.{rel}"] = value
    hidden = main["model.embed_tokens.weight"].shape[1]
    for k in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{k}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    for k in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{k}.weight"] = WEIGHT_STD * torch.randn(hidden, hidden, generator=gen)
    for k in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{k}"] = main[f"model.hc_head.hc_{k}"].clone()
    if agree:
        for k in mtp:
            if k.endswith(zero):
                mtp[k] = torch.zeros_like(mtp[k])
        mtp["mtp.0.enorm.weight"] = torch.ones(hidden)
        mtp["mtp.0.e_proj.weight"] = torch.eye(hidden)
        mtp["mtp.0.h_proj.weight"] = torch.zeros(hidden, hidden)
        mtp["mtp.0.norm.weight"] = main["model.norm.weight"].clone()
    shard = "model-mtp.safetensors"
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / shard), metadata={"format": "pt"})
    index["weight_map"] = {**weight_map, **{k: shard for k in mtp}}
    index_path.write_text(json.dumps(index, indent=2), encoding="utf-8")
    return path


def make_tiny_deepseek_v4(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny float32 V4 checkpoint into `path` (config fields of TINY_V4 overridable); return it."""
    import transformers as tf
    from tokenizers import Tokenizer

    tf.utils.logging.disable_progress_bar()
    tf.utils.logging.set_verbosity_error()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer_files(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos, eos, im_end, pad = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN))
    cfg = hf_config(vocab_size, bos, eos, pad, **overrides)
    torch.manual_seed(seed)
    model = tf.DeepseekV4ForCausalLM(cfg)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="300KB")
    if not (path / "model.safetensors.index.json").is_file():
        raise RuntimeError("expected a sharded checkpoint with an index")
    _add_fake_mtp_shard(path, cfg, seed)
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n", encoding="utf-8")
    return path


def load_hf_v4(path: str | Path) -> Any:
    """transformers' model from `path`, float32, eager attention and eager experts, EOS never stopping."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    m.set_experts_implementation("eager")
    m.generation_config.eos_token_id = None
    return m
