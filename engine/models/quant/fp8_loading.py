"""Rewrite a checkpoint's tensor stream for FP8, and turn a model's linear layers into FP8 ones (CUDA).

`fp8_weight_stream` pairs each e4m3 weight with its scale (`weight_scale_inv` or `weight_scale`, in either
order, across shards) and yields what the model loaders understand:
- for a linear layer that holds FP8 parameters (`prepare_fp8_linears`): the e4m3 weight under its own name
  and its scales in the engine layout (`fp8_tensor.row_scales`) as `<prefix>.fp8_scale`, which the loaders
  merge into qkv/gate_up exactly like weights (by row offset);
- for every other parameter (all of them on CPU): the float32 dequantized weight, rounded once to the
  model dtype by the loader's copy.
Under `quantize_at_load`, unquantized linear weights of the decoder layers are quantized first with
`quantize_fp8_block` (`quantize_fp8_channel` for rowwise plans), then take the same route, so a bf16
checkpoint loaded with quantization="fp8" gives bitwise the parameters of its offline-quantized copy.
Routed experts of a block-scaled FP8 plan stay FP8 too (models/quant/fp8_experts.py): their e4m3 weights go
to the loader, their scales straight into the experts' scale buffers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.models.quant.fp8_experts import expert_target, prepare_fp8_experts, write_expert_scales
from deepinfer.engine.models.quant.fp8_format import QuantPlan
from deepinfer.engine.models.quant.fp8_tensor import (
    FP8_DTYPE,
    dequantize_fp8,
    interleave_gate_up,
    interleave_halves,
    quantize_fp8_block,
    quantize_fp8_channel,
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


def prepare_fp8_linears(model: nn.Module, group_k: int, rowwise: bool = False) -> set[str]:
    """Give each decoder-layer `Linear` an e4m3 `weight` and a float32 `fp8_scale` [N, ceil(K/group_k)]
    (uninitialised; the loader fills them); `rowwise`: one group spanning K, `fp8_scale` [N, 1] (the
    rowwise FP8 GEMM). Returns the converted module names."""
    converted = set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not name.startswith("model.layers."):
            continue
        if name.rsplit(".", 1)[-1] in _KEEP_DENSE:
            continue
        n, k = module.weight.shape
        group = k if rowwise else group_k
        device = module.weight.device
        module.weight = nn.Parameter(torch.empty((n, k), dtype=FP8_DTYPE, device=device), requires_grad=False)
        scale = torch.empty((n, -(-k // group)), dtype=torch.float32, device=device)
        module.register_parameter(SCALE_PARAM, nn.Parameter(scale, requires_grad=False))
        module.fp8_group = group
        converted.add(name)
    return converted


def quantize_for_load(weight: torch.Tensor, plan: QuantPlan
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """(e4m3 weight, checkpoint-layout scale, block or None) of an unquantized weight under `plan`:
    per channel for rowwise plans, else `plan.load_block` tiles with the plan's K-group."""
    if plan.rowwise:
        return (*quantize_fp8_channel(weight), None)
    block = (plan.load_block[0], plan.group_k)
    return (*quantize_fp8_block(weight, block), block)


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
          fp8_modules: set[str], plan: QuantPlan, experts: dict[str, nn.Module]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    target = expert_target(name, experts)
    if target is not None:
        write_expert_scales(target, q, scale, block)
        yield name, q
        return
    prefix = _fp8_module(name, fp8_modules) if name.endswith(".weight") and q.dim() == 2 else None
    if prefix is None:
        yield name, dequantize_fp8(q, scale, block)
        return
    n, k = q.shape
    yield name, q
    yield f"{prefix}.{SCALE_PARAM}", row_scales(scale, n, k, plan.layer_group(k), block)


def fp8_weight_stream(weights: Iterable[tuple[str, torch.Tensor]], plan: QuantPlan,
                      fp8_modules: set[str] | None = None, fp8_experts: dict[str, nn.Module] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream rewritten for the model (see the module docstring).

    `fp8_modules`: module names holding FP8 parameters (from `prepare_fp8_linears`); `fp8_experts`: FP8
    experts modules (from `prepare_fp8_experts`); empty or None means every FP8 weight is dequantized.
    ValueError for a weight without its scale or a scale without weight.
    """
    fp8_modules = fp8_modules or set()
    experts = fp8_experts or {}
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
                yield from _emit(base, weights_waiting.pop(base), tensor, ckpt_block, fp8_modules, plan,
                                 experts)
            else:
                scales_waiting[base] = tensor
            continue
        if tensor.dtype == FP8_DTYPE:
            if name in scales_waiting:
                yield from _emit(name, tensor, scales_waiting.pop(name), ckpt_block, fp8_modules, plan,
                                 experts)
            else:
                weights_waiting[name] = tensor
            continue
        # An unquantized weight bound for an FP8 layer (a layer the checkpoint left in bf16) is quantized too.
        to_fp8 = (tensor.dim() == 2 and _fp8_module(name, fp8_modules) is not None
                  or expert_target(name, experts) is not None)
        if to_fp8 or (plan.quantize_at_load and tensor.dim() >= 2 and _QUANTIZABLE.match(name)):
            q, scale, block = quantize_for_load(tensor, plan)
            yield from _emit(name, q, scale, block, fp8_modules, plan, experts)
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
        reorder_swiglu_gate_up(model)
        return
    fp8_modules, experts = _prepare(model, plan)
    model.load_weights(fp8_weight_stream(weights, plan, fp8_modules, experts))
    reorder_swiglu_gate_up(model)
    mark_scale_blocks(model)


@torch.no_grad()
def reorder_swiglu_gate_up(model: nn.Module) -> None:
    """Where the ops backend computes the SwiGLU in the gate_up GEMM's epilogue, each MLP whose gate_up
    projection qualifies gets its rows reordered gate j, up j and `swiglu_in_gate_up` set: an FP8 one with one
    scale per output channel and no bias where `Ops.swiglu_in_gate_up` (weight and scales,
    `interleave_gate_up`), a 16-bit one where `Ops.swiglu_in_16bit_gate_up` (weight and bias,
    `interleave_halves`). Once, after the weights are loaded; a layer that does not qualify keeps the
    unfused path."""
    from deepinfer.engine.layers.mlp import GatedMLP

    for mlp in model.modules():
        if not isinstance(mlp, GatedMLP) or mlp.swiglu_in_gate_up:
            continue
        proj = mlp.gate_up_proj
        if proj.weight.dtype == FP8_DTYPE:
            if not mlp.ops.swiglu_in_gate_up or proj.bias is not None or proj.quant_group is not None:
                continue
            weight, scale = interleave_gate_up(proj.weight, getattr(proj, SCALE_PARAM))
            getattr(proj, SCALE_PARAM).copy_(scale)
        elif mlp.ops.swiglu_in_16bit_gate_up and proj.weight.dtype in (torch.bfloat16, torch.float16):
            weight = interleave_halves(proj.weight)
            if proj.bias is not None:
                proj.bias.copy_(interleave_halves(proj.bias))
        else:
            continue
        proj.weight.copy_(weight)
        mlp.swiglu_in_gate_up = True


# Rows per weight-scale block for which an FP8 GEMM may read one scale per tile (kernels/fp8_block_tma.py).
SCALE_BLOCK_ROWS = 128


@torch.no_grad()
def mark_scale_blocks(model: nn.Module) -> None:
    """Set `fp8_scale_block_n` on every FP8 linear: SCALE_BLOCK_ROWS where its row scales are equal within
    every aligned block of that many rows (128 x 128 block checkpoints and block quantize-at-load give that,
    merged q/k/v and gate/up too where each part starts on a block boundary), else 0 (the GEMM reads one
    scale per output row). Decided once on the loaded values: the GEMM relies on it without checking."""
    rows = SCALE_BLOCK_ROWS
    for module in model.modules():
        if not isinstance(module, Linear) or module.weight.dtype != FP8_DTYPE:
            continue
        scale = module.fp8_scale
        n = scale.shape[0]
        blocks = -(-n // rows)
        # A partial last block: its rows padded with its last one, so it passes only if its rows agree.
        padded = torch.cat([scale, scale[-1:].expand(blocks * rows - n, -1)]) if n % rows else scale
        grouped = padded.reshape(blocks, rows, -1)
        module.fp8_scale_block_n = rows if n and bool((grouped == grouped[:, :1]).all()) else 0


def _prepare(model: nn.Module, plan: QuantPlan) -> tuple[set[str], dict[str, nn.Module]]:
    """FP8 linears and (block-scaled plans only: the grouped GEMM needs K-groups) FP8 experts."""
    if not plan.fp8_compute:
        return set(), {}
    linears = prepare_fp8_linears(model, plan.group_k, plan.rowwise)
    return linears, ({} if plan.rowwise else prepare_fp8_experts(model, plan.group_k))


@torch.no_grad()
def init_dummy_with_plan(model: nn.Module, plan: QuantPlan, seed: int = 0) -> None:
    """`model.init_dummy_weights(seed)`, then (quantize_at_load or fp8_compute) every decoder-layer linear
    weight quantized block-wise: kept FP8 with its scales for FP8 compute, else dequantized in place."""
    model.init_dummy_weights(seed)
    if not (plan.quantize_at_load or plan.fp8_compute):
        reorder_swiglu_gate_up(model)
        return
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules()
             if isinstance(m, Linear) and name.startswith("model.layers.")}
    fused = {}   # fused expert weights [E, N, K], by checkpoint name (what expert_target reads)
    for name, m in model.named_modules():
        for p in ("gate_up_proj", "down_proj"):
            w = getattr(m, p, None)
            if name.startswith("model.layers.") and isinstance(w, torch.Tensor) and w.dim() == 3:
                fused[f"{name}.{p}"] = w.detach().clone()
    fp8_modules, experts = _prepare(model, plan)
    modules = dict(model.named_modules())
    for name, weight in dense.items():
        q, scale, block = quantize_for_load(weight, plan)
        module = modules[name]
        if name in fp8_modules:
            module.weight.copy_(q)
            getattr(module, SCALE_PARAM).copy_(row_scales(scale, *q.shape, module.fp8_group, block))
        else:
            module.weight.copy_(dequantize_fp8(q, scale, block))
    for name, weight in fused.items():   # FP8 experts only: other expert weights keep the dummy values
        target = expert_target(name, experts)
        if target is not None:
            q, scale, block = quantize_for_load(weight, plan)
            getattr(target[0], target[1]).copy_(q)
            write_expert_scales(target, q, scale, block)
    reorder_swiglu_gate_up(model)
    mark_scale_blocks(model)
