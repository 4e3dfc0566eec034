"""Map DeepSeek-V2/V3 checkpoint tensors onto the model's (partly fused) parameters.

Accepted layouts, in any mix and over any number of safetensors shards:
- per-expert tensors `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` (DeepSeek's checkpoints and
  what transformers 5.x save_pretrained writes), or fused `mlp.experts.gate_up_proj` [E, 2I, H] /
  `mlp.experts.down_proj` [E, H, I] (transformers' in-memory layout, e.g. a saved state_dict);
- `gate_proj` / `up_proj` of the dense MLPs and shared experts, merged here into `gate_up_proj`.
MTP layers (`model.layers.{num_hidden_layers + i}.*`, i < num_nextn_predict_layers) are skipped here; with MTP
speculative decoding on, engine/spec_decode/setup.py keeps them from the same stream for the draft model.
FP8 checkpoints reach this loader through models/quant/fp8_loading.py, which
turns their scales into dequantized weights or `fp8_scale` rows (merged here like the weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MERGED = re.compile(
    r"^(model\.layers\.\d+\.mlp\.(?:shared_experts\.)?)(gate|up)_proj\.(weight|bias|fp8_scale)$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(?:\.weight)?$")

Shard = tuple[int, str] | str | None
Select = Callable[[torch.Tensor], torch.Tensor]


def _shards_of(pname: str, param: torch.Tensor) -> set[Shard]:
    """The pieces a parameter is assembled from (all must be loaded)."""
    if pname.endswith(".experts.gate_up_proj"):
        return {(e, s) for e in range(param.shape[0]) for s in ("gate", "up")}
    if pname.endswith(".experts.down_proj"):
        return {(e, "down") for e in range(param.shape[0])}
    if pname.endswith((".gate_up_proj.weight", ".gate_up_proj.bias", ".gate_up_proj.fp8_scale")):
        return {"gate", "up"}
    return {None}


def _target(name: str, params: dict[str, torch.Tensor]) -> tuple[str, Select, set[Shard] | None] | None:
    """(parameter, how to select the destination inside it, shards covered; None = all) for a tensor name."""
    if m := _MERGED.match(name):
        prefix, part, kind = m.groups()
        pname = f"{prefix}gate_up_proj.{kind}"
        if pname not in params:
            return None
        half = params[pname].shape[0] // 2
        lo = 0 if part == "gate" else half
        return pname, (lambda p: p[lo:lo + half]), {part}
    if m := _EXPERT.match(name):
        prefix, expert, part = m.groups()
        e = int(expert)
        pname = f"{prefix}{'down_proj' if part == 'down' else 'gate_up_proj'}"
        if pname not in params or e >= params[pname].shape[0]:
            return None
        if part == "down":
            return pname, (lambda p: p[e]), {(e, "down")}
        half = params[pname].shape[1] // 2
        lo = 0 if part == "gate" else half
        return pname, (lambda p: p[e, lo:lo + half]), {(e, part)}
    if m := _FUSED.match(name):
        pname = f"{m.group(1)}{m.group(2)}"
        return (pname, (lambda p: p), None) if pname in params else None
    return (name, (lambda p: p), None) if name in params else None


@torch.no_grad()
def load_deepseek_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (hf_name, tensor) pairs into a DeepSeek model, converting dtype/device on copy.

    ValueError for a tensor the model has no place for, a shape mismatch, an FP8 scale tensor, or
    parameters the checkpoint did not provide.
    """
    cfg = model.config
    arch = cfg.architecture
    params = dict(model.named_parameters())
    needed = {(p, s) for p, t in params.items() for s in _shards_of(p, t)}
    loaded: set[tuple[str, Shard]] = set()
    mtp_layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_mtp_layers)
    for name, tensor in weights:
        if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) in mtp_layers:
            continue  # an MTP module: loaded later by speculative decoding, not by this model
        if name.endswith(("weight_scale_inv", "weight_scale")):
            # FP8 scales are consumed by models/quant/fp8_loading.py before they get here (LLM does that).
            raise ValueError(f"checkpoint tensor {name!r}: a block-FP8 scale reached the plain loader; load "
                             "FP8 checkpoints through LLM (quantization='auto' or None) or fp8_weight_stream")
        target = _target(name, params)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {arch} (does "
                             "config.json match the weights?)")
        pname, select, shards = target
        dest = select(params[pname])
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(dest.shape)} (does config.json match the weights?)")
        dest.copy_(tensor)
        covered = shards if shards is not None else _shards_of(pname, params[pname])
        loaded.update((pname, s) for s in covered)
    missing = sorted({p if s is None else f"{p}[{s}]" for p, s in needed - loaded})
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint lacks weights for: {shown}")
