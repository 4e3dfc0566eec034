"""Tiny random-weight DeepSeek-V2/V3 checkpoints, built and saved with transformers' own classes.

`make_tiny_deepseek(variant, path)` writes a complete model directory: config.json, sharded safetensors with
model.safetensors.index.json (as big checkpoints come), generation_config.json and the demo tokenizer. V3
variants also carry a fake MTP layer (`model.layers.{num_hidden_layers}.*`) in its own shard, which the engine
must load and ignore; `write_mtp_layer` gives one a complete MTP layer (random, or one that always agrees with
the target) for speculative decoding. `write_fused_experts_copy` rewrites a checkpoint with experts fused per
layer (transformers' in-memory layout) instead of per-expert tensors.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepinfer.engine.models.demo import BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN, write_tokenizer_files

WEIGHT_STD = 0.1    # as tiny_models: spread logits so greedy picks are far from ties
_MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, max_position_embeddings=512, rms_norm_eps=1e-6)
_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}

# variant -> (transformers config class name, config fields beyond _MLA)
VARIANTS: dict[str, tuple[str, dict]] = {
    # V3 as released: q LoRA, a dense first layer, YaRN with its mscale, interleaved rope, sigmoid routing.
    "v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True, rope_parameters=_YARN)),
    # q_lora_rank null, every layer MoE, plain rope in halves, no normalisation of the top-k weights.
    "v3_qnull": ("DeepseekV3Config", dict(
        num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=0, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=False, rope_interleave=False,
        rope_parameters=_PLAIN_ROPE)),
    # V2: softmax routing, group-limited greedy, two shared experts, complex (interleaved) rope.
    "v2": ("DeepseekV2Config", dict(
        num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.0, rope_parameters=_PLAIN_ROPE)),
    # V2-Lite style: greedy top-k, q LoRA.
    "v2_greedy": ("DeepseekV2Config", dict(
        num_hidden_layers=2, q_lora_rank=24, first_k_dense_replace=0, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, topk_method="greedy", routed_scaling_factor=1.0,
        rope_parameters=_PLAIN_ROPE)),
}


def hf_config(variant: str, vocab_size: int, bos: int, eos: int, pad: int, **overrides: Any) -> Any:
    """The transformers config object of `variant` (`overrides`: config fields to set instead, e.g. a longer
    max_position_embeddings)."""
    import transformers as tf

    cls_name, extra = VARIANTS[variant]
    # a copy: transformers fills rope_parameters in place
    fields = {**_MLA, **copy.deepcopy(extra), **overrides}
    return getattr(tf, cls_name)(**fields, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                                 pad_token_id=pad, tie_word_embeddings=False)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded values for every parameter and for the router's correction bias (a buffer HF zeroes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else WEIGHT_STD * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def add_indexed_shard(path: Path, shard: str, tensors: dict[str, torch.Tensor]) -> None:
    """Save `tensors` as the safetensors file `shard` of the sharded checkpoint at `path` and list them in
    its model.safetensors.index.json."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index["weight_map"].update({name: shard for name in tensors})
    index_path.write_text(json.dumps(index, indent=2), encoding="utf-8")


def _add_fake_mtp_shard(path: Path, cfg: Any, seed: int) -> None:
    """A shard of `model.layers.{L}.*` tensors shaped like DeepSeek-V3's MTP module, listed in the index."""
    gen = torch.Generator().manual_seed(seed + 1)
    layer, hidden = f"model.layers.{cfg.num_hidden_layers}", cfg.hidden_size
    shapes = {
        "enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (cfg.vocab_size, hidden),
        "embed_tokens.weight": (cfg.vocab_size, hidden), "input_layernorm.weight": (hidden,),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden),
        "mlp.experts.0.gate_proj.weight": (cfg.moe_intermediate_size, hidden),
        "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,),
    }
    tensors = {f"{layer}.{k}": torch.randn(s, generator=gen) for k, s in shapes.items()}
    add_indexed_shard(path, "model-mtp.safetensors", tensors)


def _zero_outputs(tensors: dict[str, torch.Tensor]) -> None:
    """Zero every attention and MLP output projection: each block then adds nothing to the residual."""
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight", "experts.down_proj")):
            t.zero_()


def write_mtp_layer(path: str | Path, seed: int = 0, agree: bool = False) -> Path:
    """Give checkpoint `path` (a V3 variant) a complete MTP layer `model.layers.{L}.*` in DeepSeek's naming:
    enorm, hnorm, eh_proj, a decoder block shaped like the last layer, shared_head.{norm,head}, embed_tokens
    (the head and embedding are copies of the target's, as DeepSeek's checkpoints carry them). Replaces the
    fake MTP shard. Random weights, or with `agree=True` a construction whose draft always agrees:

    every block of the target and of the MTP layer gets zero output projections, so the target's final
    hidden state is norm(embed(t)) and it predicts a fixed function of the current token (a bigram map);
    the MTP layer takes only its embedding half (eh_proj = [I | 0], enorm weight 1) and shares the final
    norm's weight and the LM head, so its logits are the target's for the token it is fed times a positive
    factor (the two RMSNorms in a row): the same argmax. The LM head is scaled up so greedy picks are clear
    and the draft is confident.
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    prefix = f"model.layers.{layers}."
    weight_map = {k: v for k, v in index["weight_map"].items() if not k.startswith(prefix)}
    shards = {f: load_file(str(path / f)) for f in sorted(set(weight_map.values()))}
    main = {k: t for tensors in shards.values() for k, t in tensors.items()}
    if agree:
        for tensors in shards.values():
            _zero_outputs(tensors)
            if "lm_head.weight" in tensors:
                tensors["lm_head.weight"].mul_(20.0)
        for f, tensors in shards.items():
            save_file(tensors, str(path / f), metadata={"format": "pt"})
    gen = torch.Generator().manual_seed(seed + 7)
    last = f"model.layers.{layers - 1}."
    mtp: dict[str, torch.Tensor] = {}
    for name, t in main.items():
        if name.startswith(last):
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            scale = 0.1 if name.endswith("e_score_correction_bias") else WEIGHT_STD
            value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise
            mtp[prefix + name.removeprefix(last)] = value.to(t.dtype)
    for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[prefix + k] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[prefix + "eh_proj.weight"] = WEIGHT_STD * torch.randn(hidden, 2 * hidden, generator=gen)
    mtp[prefix + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    mtp[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    if agree:
        _zero_outputs(mtp)
        mtp[prefix + "enorm.weight"] = torch.ones(hidden)
        mtp[prefix + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        mtp[prefix + "shared_head.norm.weight"] = main["model.norm.weight"].clone()
    shard = "model-mtp.safetensors"
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / shard), metadata={"format": "pt"})
    index["weight_map"] = {**weight_map, **{k: shard for k in mtp}}
    index_path.write_text(json.dumps(index, indent=2), encoding="utf-8")
    return path


def make_tiny_deepseek(variant: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny float32 checkpoint of `variant` (see VARIANTS; `overrides`: config fields to change)
    into `path`; return the path."""
    import transformers as tf
    from tokenizers import Tokenizer

    tf.utils.logging.disable_progress_bar()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer_files(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos, eos, im_end, pad = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN))
    cfg = hf_config(variant, vocab_size, bos, eos, pad, **overrides)
    torch.manual_seed(seed)
    model = getattr(tf, VARIANTS[variant][0].replace("Config", "ForCausalLM"))(cfg)
    _randomize(model, seed)
    # Small shards, so the checkpoint comes with an index as real ones do.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    if not (path / "model.safetensors.index.json").is_file():
        raise RuntimeError("expected a sharded checkpoint with an index")
    if variant.startswith("v3"):
        _add_fake_mtp_shard(path, cfg, seed)
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n", encoding="utf-8")
    return path


def tiny_deepseek_builder(root: str | Path) -> Callable[[str], Path]:
    """variant -> its checkpoint under `root`/variant, built on the first request only (a module fixture's
    value: each test module builds only the variants it runs, once)."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_tiny_deepseek(variant, Path(root) / variant)
        return built[variant]

    return get


def write_fused_experts_copy(src: str | Path, dst: str | Path) -> Path:
    """Copy checkpoint `src` to `dst` with each layer's experts fused into `mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (one unindexed file), as a transformers state_dict
    holds them."""
    import re
    import shutil

    from deepinfer.engine.models.loader import iter_weights
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    pattern = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in iter_weights(src, "cpu"):
        m = pattern.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        if len(parts) != 3 * count:  # an incomplete set (the fake MTP layer): keep it as it was
            out.update({f"{prefix}{e}.{kind}_proj.weight": t for (e, kind), t in parts.items()})
            continue
        out[f"{prefix}gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(count)])
        out[f"{prefix}down_proj"] = torch.stack([parts[(e, "down")] for e in range(count)])
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst
