"""Rewrite a checkpoint's tensor stream for FP8, and turn a model's linear layers into FP8 ones (CUDA).

`fp8_weight_stream` pairs each e4m3 weight with its scale (`weight_scale_inv` or `weight_scale`, in either
order, across shards) and yields what the model loaders understand:
- for a linear layer that holds FP8 parameters (`prepare_fp8_linears`): the e4m3 weight under its own name
  and its scales in the engine layout (`fp8_tensor.row_scales`) as `<prefix>.fp8_scale`, which the loaders
  merge into qkv/gate_up exactly like weights (by row offset);
- for every other parameter (all of them on CPU): the float32 dequantized weight, rounded once to the
  model dtype by the loader's copy.
Under `quantize_at_load`, unquantized linear weights of the decoder layers are quantized first with
`quantize_fp8_block`, then take the same route, so a bf16 checkpoint loaded with quantization="fp8" gives
bitwise the parameters of its offline-quantized copy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.models.quant.fp8_format import QuantPlan
from deepinfer.engine.models.quant.fp8_tensor import (
    FP8_DTYPE,
    dequantize_fp8,
    quantize_fp8_block,
    row_scales,
)
from torch import nn

# Linear weights of the decoder layers (what FP8 checkpoints quantize): projections and experts; never the
# router (`mlp.gate.weight`), norms, embeddings or the LM head.
_QUANTIZABLE = re.compile(r"^model\.layers\.\d+\..*(_proj|_proj_with_mqa)(\.weight)?$")
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# Static activation / KV scales of some FP8 releases: activations are quantized per token-group on the fly
# and the FP8 KV cache has its own scales, so these are not used.
_DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale", ".activation_scale")
# Layers whose weight a model reads raw (MLA's kv_b_proj is split per head inside attention): kept in the
# model dtype even when FP8 compute is on.
_KEEP_DENSE = ("kv_b_proj",)
_MERGES = (
    (re.compile(r"\.self_attn\.[qkv]_proj$"), ".self_attn.qkv_proj"),
    (re.compile(r"\.(gate|up)_proj$"), ".gate_up_proj"),
)
SCALE_PARAM = "fp8_scale"


def prepare_fp8_linears(model: nn.Module, group_k: int) -> set[str]:
    """Give each decoder-layer `Linear` an e4m3 `weight` and a float32 `fp8_scale` [N, ceil(K/group_k)]
    (uninitialised; the loader fills them). Returns the converted module names."""
    converted = set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not name.startswith("model.layers."):
            continue
        if name.rsplit(".", 1)[-1] in _KEEP_DENSE:
            continue
        n, k = module.weight.shape
        device = module.weight.device
        module.weight = nn.Parameter(torch.empty((n, k), dtype=FP8_DTYPE, device=device), requires_grad=False)
        scale = torch.empty((n, -(-k // group_k)), dtype=torch.float32, device=device)
        module.register_parameter(SCALE_PARAM, nn.Parameter(scale, requires_grad=False))
        module.fp8_group = group_k
        converted.add(name)
    return converted


def _fp8_module(weight_name: str, fp8_modules: set[str]) -> str | None:
    """The converted module a checkpoint weight goes to (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    prefix = weight_name.removesuffix(".weight")
    if prefix in fp8_modules:
        return prefix
    for pattern, merged in _MERGES:
        candidate = pattern.sub(merged, prefix)
        if candidate != prefix and candidate in fp8_modules:
            return prefix
    return None


def _emit(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
          fp8_modules: set[str], group_k: int) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = _fp8_module(name, fp8_modules) if name.endswith(".weight") and q.dim() == 2 else None
    if prefix is None:
        yield name, dequantize_fp8(q, scale, block)
        return
    n, k = q.shape
    yield name, q
    yield f"{prefix}.{SCALE_PARAM}", row_scales(scale, n, k, group_k, block)


def fp8_weight_stream(weights: Iterable[tuple[str, torch.Tensor]], plan: QuantPlan,
                      fp8_modules: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream rewritten for the model (see the module docstring).

    `fp8_modules`: module names holding FP8 parameters (from `prepare_fp8_linears`); empty or None means
    every FP8 weight is dequantized. ValueError for a weight without its scale or a scale without weight.
    """
    fp8_modules = fp8_modules or set()
    group_k = plan.group_k
    ckpt_block = plan.checkpoint.block if plan.checkpoint is not None else None
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            base = name.removesuffix(suffix) + ".weight"
            if base in weights_waiting:
                yield from _emit(base, weights_waiting.pop(base), tensor, ckpt_block, fp8_modules, group_k)
            else:
                scales_waiting[base] = tensor
            continue
        if tensor.dtype == FP8_DTYPE:
            if name in scales_waiting:
                yield from _emit(name, tensor, scales_waiting.pop(name), ckpt_block, fp8_modules, group_k)
            else:
                weights_waiting[name] = tensor
            continue
        # An unquantized weight bound for an FP8 layer (a layer the checkpoint left in bf16) is quantized too.
        to_fp8 = tensor.dim() == 2 and _fp8_module(name, fp8_modules) is not None
        if to_fp8 or (plan.quantize_at_load and tensor.dim() >= 2 and _QUANTIZABLE.match(name)):
            block = (plan.load_block[0], group_k)
            yield from _emit(name, *quantize_fp8_block(tensor, block), block, fp8_modules, group_k)
            continue
        yield name, tensor
    if weights_waiting or scales_waiting:
        lost = sorted(weights_waiting) + [f"scale of {n}" for n in sorted(scales_waiting)]
        raise ValueError("FP8 checkpoint: weights and scales that never met their pair: "
                         f"{', '.join(lost[:6])}"
                         f"{' ...' if len(lost) > 6 else ''} (is the checkpoint complete?)")


def load_with_plan(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], plan: QuantPlan) -> None:
    """`model.load_weights` through the FP8 plan: converts linear layers first when `plan.fp8_compute`."""
    if not plan.touches_weights:
        model.load_weights(weights)
        return
    fp8_modules = prepare_fp8_linears(model, plan.group_k) if plan.fp8_compute else set()
    model.load_weights(fp8_weight_stream(weights, plan, fp8_modules))


@torch.no_grad()
def init_dummy_with_plan(model: nn.Module, plan: QuantPlan, seed: int = 0) -> None:
    """`model.init_dummy_weights(seed)`, then (quantize_at_load or fp8_compute) every decoder-layer linear
    weight quantized block-wise: kept FP8 with its scales for FP8 compute, else dequantized in place."""
    model.init_dummy_weights(seed)
    if not (plan.quantize_at_load or plan.fp8_compute):
        return
    group_k = plan.group_k
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules()
             if isinstance(m, Linear) and name.startswith("model.layers.")}
    fp8_modules = prepare_fp8_linears(model, group_k) if plan.fp8_compute else set()
    modules = dict(model.named_modules())
    for name, weight in dense.items():
        block = (plan.load_block[0], group_k)
        q, scale = quantize_fp8_block(weight, block)
        module = modules[name]
        if name in fp8_modules:
            module.weight.copy_(q)
            getattr(module, SCALE_PARAM).copy_(row_scales(scale, *q.shape, group_k, block))
        else:
            module.weight.copy_(dequantize_fp8(q, scale, block))
