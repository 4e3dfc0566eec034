"""The fused FP8 activation-quantization wiring on CPU: norms and SiLU-and-mul hand FP8 linears rows already
quantized (`QuantizedActivation`: per row for rowwise layers, per token and K-group for block-scaled ones)
when the backend says so, with the same logits bit for bit.

A tiny float32 Llama with quantization="fp8-channel" (rowwise) or "fp8" (block-scaled, 32 x 32 blocks so
the tiny layers have several K-groups) built as on CUDA (FP8 parameters, the shared `Ops` references); one
backend quantizing in the linears (CPU's default: `fuses_fp8_row_quant` off), one whose norms / activation
quantize for them (the flag on, counting the calls so the fused wiring is known to run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.engine.layers.ops import QuantizedActivation

from tests.support.paged_runner import two_prompt_logits


class _FusingOps(CpuInvariantOps):
    """CPU ops whose producers quantize for FP8 rowwise linears (the shared compositions), counted."""

    fuses_fp8_row_quant = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def add_rms_norm_quant(self, x, residual, weight, eps, group=None):
        self.calls["norm" if group is None else "norm_groups"] += 1
        return super().add_rms_norm_quant(x, residual, weight, eps, group)

    def silu_and_mul_quant(self, x, group=None):
        self.calls["act" if group is None else "act_groups"] += 1
        return super().silu_and_mul_quant(x, group)

    def fp8_linear(self, x, weight, weight_scale, bias, group, scale_block_n=0):
        self.calls["quantized_in" if isinstance(x, QuantizedActivation) else "bf16_in"] += 1
        return super().fp8_linear(x, weight, weight_scale, bias, group, scale_block_n)


def _fp8_model(path, ops, quantization: str = "fp8-channel"):
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import plan_quantization
    from deepinfer.engine.models.quant.fp8_loading import load_with_plan
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    plan = replace(plan_quantization(quantization, None, "cpu"), fp8_compute=True)
    if quantization == "fp8":
        plan = replace(plan, load_block=(32, 32))
    model = build_model(cfg, ops, torch.float32, "cpu")
    load_with_plan(model, iter_weights(path, "cpu"), plan)
    return model, cfg


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("quantization", ["fp8-channel", "fp8"])
def test_fused_quantization_wiring_gives_the_same_logits(llama, quantization):
    plain, cfg = _fp8_model(llama, CpuInvariantOps(), quantization)
    fusing_ops = _FusingOps()
    fused, _ = _fp8_model(llama, fusing_ops, quantization)
    layers = cfg.num_hidden_layers
    assert not any(m.takes_quantized_rows for n, m in plain.named_modules() if n.endswith("_proj"))
    want, got = two_prompt_logits(plain, cfg), two_prompt_logits(fused, cfg)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    steps = 4
    # Per layer and step: both norms and the activation quantize (per K-group for block-scaled layers);
    # qkv, gate_up and down take their rows, o_proj (fed by attention) quantizes its own input.
    suffix = "" if quantization == "fp8-channel" else "_groups"
    assert fusing_ops.calls == Counter({f"norm{suffix}": 2 * layers * steps, f"act{suffix}": layers * steps,
                                        "quantized_in": 3 * layers * steps, "bf16_in": layers * steps})
    if quantization == "fp8":
        # 32 x 32 blocks: the loader found the row scales equal per 128-row block only where it holds.
        blocks = {n: m.fp8_scale_block_n for n, m in fused.named_modules() if n.endswith("_proj")}
        assert set(blocks.values()) <= {0, 128} and all(m.quant_group == 32 for n, m in fused.named_modules()
                                                        if n.endswith("_proj"))


def _fp8_linear(ops, n: int, k: int, group: int):
    """An engine Linear converted to FP8 by hand: e4m3 weight [n, k], row scales [n, ceil(k / group)]."""
    from deepinfer.engine.layers.linear import Linear

    layer = Linear(k, n, False, ops, torch.float32)
    layer.weight = torch.nn.Parameter(torch.ones(n, k).to(torch.float8_e4m3fn), requires_grad=False)
    layer.register_parameter("fp8_scale", torch.nn.Parameter(torch.ones(n, -(-k // group)),
                                                             requires_grad=False))
    layer.fp8_group = group
    return layer


def test_fp8_layers_take_rows_quantized_as_their_weights_are(llama):
    from deepinfer.engine.layers.linear import Linear

    ops = _FusingOps()
    rowwise, _ = _fp8_model(llama, ops)
    assert all(m.takes_quantized_rows and m.quant_group is None
               for n, m in rowwise.named_modules() if n.endswith("_proj"))
    assert _fp8_linear(ops, 8, 64, 64).quant_group is None
    assert _fp8_linear(ops, 8, 64, 128).quant_group is None        # one K-group wider than K: rowwise too
    block = _fp8_linear(ops, 8, 64, 16)                              # K-groups: rows quantized per group
    assert block.takes_quantized_rows and block.quant_group == 16
    assert not _fp8_linear(CpuInvariantOps(), 8, 64, 64).takes_quantized_rows
    assert Linear(64, 4, False, ops, torch.float32).quant_group is None
    rows = QuantizedActivation(torch.ones(2, 64).to(torch.float8_e4m3fn), torch.ones(2, 1), torch.float32)
    assert torch.equal(_fp8_linear(ops, 8, 64, 64)(rows), torch.full((2, 8), 64.0))
    ones = torch.ones(2, 64).to(torch.float8_e4m3fn)
    groups = QuantizedActivation(ones, torch.ones(2, 4), torch.float32, 16)
    assert torch.equal(block(groups), torch.full((2, 8), 64.0))
    with pytest.raises(ValueError, match="one weight scale per output channel"):
        block(rows)
    with pytest.raises(ValueError, match="K-group of 16"):
        _fp8_linear(ops, 8, 64, 32)(groups)                          # another K-group than the layer's
    with pytest.raises(ValueError, match="needs an FP8 layer"):
        Linear(64, 4, False, ops, torch.float32)(rows)


class _SwigluOps(_FusingOps):
    """`_FusingOps` whose MLPs compute the SwiGLU in the gate_up linear (the shared composition of
    `Ops.fp8_swiglu_linear` over weights the loader reordered gate j, up j), counted."""

    swiglu_in_gate_up = True

    def fp8_swiglu_linear(self, x, weight, weight_scale):
        self.calls["swiglu_gate_up"] += 1
        return super().fp8_swiglu_linear(x, weight, weight_scale)


@pytest.mark.parametrize("quantization,reordered", [("fp8-channel", True), ("fp8", False)])
def test_swiglu_in_gate_up_wiring_gives_the_same_logits(llama, quantization, reordered):
    from deepinfer.engine.layers.mlp import GatedMLP

    plain, cfg = _fp8_model(llama, _FusingOps(), quantization)
    ops = _SwigluOps()
    fused, _ = _fp8_model(llama, ops, quantization)
    mlps = [m for m in fused.modules() if isinstance(m, GatedMLP)]
    # Rowwise gate_up projections are reordered and marked at load; block-scaled ones keep the plain path.
    assert mlps and all(m.swiglu_in_gate_up == reordered for m in mlps)
    want, got = two_prompt_logits(plain, cfg), two_prompt_logits(fused, cfg)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    layers, steps = cfg.num_hidden_layers, 4
    assert ops.calls["swiglu_gate_up"] == (layers * steps if reordered else 0)
    assert ops.calls["act" if reordered else "act_groups"] == (0 if reordered else layers * steps)
    if reordered:   # the gate_up weight's rows alternate gate j, up j
        name = next(n for n, m in fused.named_modules() if isinstance(m, GatedMLP))
        w_plain = dict(plain.named_modules())[name].gate_up_proj.weight.view(torch.uint8)
        w_fused = dict(fused.named_modules())[name].gate_up_proj.weight.view(torch.uint8)
        i = w_plain.shape[0] // 2
        assert torch.equal(w_fused[0::2], w_plain[:i]) and torch.equal(w_fused[1::2], w_plain[i:])
