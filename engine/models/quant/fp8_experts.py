"""FP8 routed experts (DeepSeek MoE on CUDA): e4m3 fused expert weights with row scales beside them.

`prepare_fp8_experts` turns each `FusedExperts` module's `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
into e4m3 parameters of the same shapes and registers float32 row-scale buffers `gate_up_scale`
[E, 2I, ceil(H / group)] and `down_scale` [E, H, ceil(I / group)] (the engine layout of
models/quant/fp8_tensor.py, per expert), which the grouped FP8 GEMM reads (kernels/fp8_moe.py).

The scales are buffers, not parameters: the DeepSeek loader (models/deepseek_weights.py) fills the e4m3
weights from the checkpoint stream as usual (per-expert or fused tensors) and checks that every one arrived,
while `write_expert_scales` stores each weight's scales at the same time from the FP8 stream
(models/quant/fp8_loading.py), so a loaded weight always has its scales.
"""

from __future__ import annotations

import re

import torch
from deepinfer.engine.layers.moe import FusedExperts
from deepinfer.engine.models.quant.fp8_tensor import FP8_DTYPE, row_scales
from torch import nn

SCALE_OF = {"gate_up_proj": "gate_up_scale", "down_proj": "down_scale"}
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


def prepare_fp8_experts(model: nn.Module, group_k: int) -> dict[str, nn.Module]:
    """Convert every DeepSeek `FusedExperts` module of the decoder layers to FP8 (see the module docstring;
    other expert layouts, e.g. DeepSeek-V4's, keep their dtype). Returns {module name: module}."""
    converted = {}
    for name, module in model.named_modules():
        if not name.startswith("model.layers.") or type(module) is not FusedExperts:
            continue
        for pname, sname in SCALE_OF.items():
            experts, n, k = getattr(module, pname).shape
            device = getattr(module, pname).device
            setattr(module, pname, nn.Parameter(torch.empty((experts, n, k), dtype=FP8_DTYPE, device=device),
                                                requires_grad=False))
            module.register_buffer(sname, torch.empty((experts, n, -(-k // group_k)), dtype=torch.float32,
                                                      device=device), persistent=False)
        module.fp8_group = group_k
        converted[name] = module
    return converted


def expert_target(name: str, experts: dict[str, nn.Module]) -> tuple[nn.Module, str, slice | None,
                                                                     int | None] | None:
    """(module, parameter, rows inside one expert or None = all, expert or None = all) of a checkpoint
    expert weight bound for an FP8 experts module; None for any other tensor."""
    if m := _PER_EXPERT.match(name):
        prefix, expert, part = m.groups()
        module = experts.get(prefix)
        if module is None:
            return None
        if part == "down":
            return module, "down_proj", None, int(expert)
        half = module.gate_up_proj.shape[1] // 2
        rows = slice(0, half) if part == "gate" else slice(half, 2 * half)
        return module, "gate_up_proj", rows, int(expert)
    if m := _FUSED.match(name):
        module = experts.get(m.group(1))
        return (module, m.group(2), None, None) if module is not None else None
    return None


@torch.no_grad()
def write_expert_scales(target: tuple[nn.Module, str, slice | None, int | None], q: torch.Tensor,
                        scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """Store the row scales of expert weight `q` (its checkpoint `scale`, `block` tiles) into the module's
    scale buffer at the place `target` (from `expert_target`) names."""
    module, pname, rows, expert = target
    dest = getattr(module, SCALE_OF[pname])
    group = module.fp8_group
    if expert is None:      # fused [E, N, K] with a scale grid per expert
        if q.dim() != 3 or q.shape[0] != dest.shape[0]:
            raise ValueError(f"fused expert weight of shape {tuple(q.shape)} for {tuple(dest.shape[:2])} x K")
        for e in range(q.shape[0]):
            dest[e].copy_(row_scales(scale[e] if scale.numel() > 1 else scale, *q.shape[1:], group, block))
        return
    n, k = q.shape
    part = dest[expert] if rows is None else dest[expert, rows]
    if part.shape[0] != n:
        raise ValueError(f"expert weight of shape {tuple(q.shape)}: the model expects {part.shape[0]} rows")
    part.copy_(row_scales(scale, n, k, group, block))
