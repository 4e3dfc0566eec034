"""Map Hugging Face checkpoint tensors onto the decoder's (merged) parameters; seeded dummy weights."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from deepinfer.engine.layers.norm import RMSNorm
from torch import nn

# HF name pattern -> (our merged parameter, the shard order inside it). `fp8_scale` rows (FP8 layers, see
# models/quant/fp8_loading.py) merge exactly like the weight rows they scale.
_MERGED = (
    (re.compile(r"^(model\.layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias|fp8_scale)$"), "qkv_proj",
     "qkv"),
    (re.compile(r"^(model\.layers\.\d+\.mlp\.)(gate|up)_proj\.(weight|bias|fp8_scale)$"), "gate_up_proj",
     ("gate", "up")),
)
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
DUMMY_STD = 0.02


def _shard_sizes(model: nn.Module) -> dict[str, dict[str, int]]:
    cfg = model.config
    return {
        "qkv_proj": {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
        "gate_up_proj": {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
    }


def _target(name: str, sizes: dict[str, dict[str, int]]) -> tuple[str, str | None, int, int] | None:
    """(our parameter name, shard, row offset, rows) for an HF tensor name; None when it maps 1:1."""
    for pattern, merged, order in _MERGED:
        match = pattern.match(name)
        if match:
            prefix, shard, kind = match.groups()
            shard_sizes = sizes[merged]
            offset = 0
            for s in order:
                if s == shard:
                    break
                offset += shard_sizes[s]
            return f"{prefix}{merged}.{kind}", shard, offset, shard_sizes[shard]
    return None


@torch.no_grad()
def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (hf_name, tensor) pairs into `model`'s parameters, converting dtype/device as needed.

    Merges q/k/v into qkv_proj and gate/up into gate_up_proj, skips lm_head.weight when the embeddings are
    tied and rotary inv_freq buffers. Raises ValueError for a name the model has no place for, a shape
    mismatch, or parameters the checkpoint did not provide.
    """
    params = dict(model.named_parameters())
    sizes = _shard_sizes(model)
    tied = model.config.tie_word_embeddings
    needed: set[tuple[str, str | None]] = set()
    for pname in params:
        for merged, shard_sizes in sizes.items():
            if f".{merged}." in pname:
                needed.update((pname, s) for s in shard_sizes)
                break
        else:
            needed.add((pname, None))
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor in weights:
        if _IGNORED.search(name) or (tied and name == "lm_head.weight"):
            continue
        target = _target(name, sizes)
        if target is None:
            pname, shard = name, None
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{model.config.architecture}")
            dest = params[pname]
        else:
            pname, shard, offset, rows = target
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{model.config.architecture}")
            dest = params[pname][offset:offset + rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(dest.shape)} (does config.json match the weights?)")
        dest.copy_(tensor)
        loaded.add((pname, shard))
    missing = sorted(f"{p}[{s}]" if s else p for p, s in needed - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint lacks weights for: {shown}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights: norm weights 1, everything else normal(0, DUMMY_STD); same seed, same values."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, p in model.named_parameters():
        if id(p) in norm_weights:
            p.fill_(1.0)
            continue
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.normal_(0.0, DUMMY_STD, generator=gen)
