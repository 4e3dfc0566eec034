"""The fused FP8 activation-quantization wiring on CPU: norms and SiLU-and-mul hand FP8 rowwise linears
rows already quantized (`QuantizedActivation`) when the backend says so, with the same logits bit for bit.

A tiny float32 Llama with quantization="fp8-channel" built as on CUDA (FP8 parameters, the shared `Ops`
references); one backend quantizing in the linears (CPU's default: `fuses_fp8_row_quant` off), one whose
norms / activation quantize for them (the flag on, counting the calls so the fused wiring is known to run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.engine.layers.ops import QuantizedActivation

from tests.support.paged_runner import PagedBatchRunner


class _FusingOps(CpuInvariantOps):
    """CPU ops whose producers quantize for FP8 rowwise linears (the shared compositions), counted."""

    fuses_fp8_row_quant = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def add_rms_norm_quant(self, x, residual, weight, eps):
        self.calls["norm"] += 1
        return super().add_rms_norm_quant(x, residual, weight, eps)

    def silu_and_mul_quant(self, x):
        self.calls["act"] += 1
        return super().silu_and_mul_quant(x)

    def fp8_linear(self, x, weight, weight_scale, bias, group):
        self.calls["quantized_in" if isinstance(x, QuantizedActivation) else "bf16_in"] += 1
        return super().fp8_linear(x, weight, weight_scale, bias, group)


def _fp8_model(path, ops, quantization: str = "fp8-channel"):
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import plan_quantization
    from deepinfer.engine.models.quant.fp8_loading import load_with_plan
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    plan = replace(plan_quantization(quantization, None, "cpu"), fp8_compute=True)
    model = build_model(cfg, ops, torch.float32, "cpu")
    load_with_plan(model, iter_weights(path, "cpu"), plan)
    return model, cfg


def _run(model, cfg) -> list[torch.Tensor]:
    """Two prompts prefilled together, then three decode steps of both: every step's logits."""
    runner = PagedBatchRunner(model, cfg)
    runner.add("a", [5, 17, 3, 40, 22, 9, 31])
    runner.add("b", [8, 2, 61, 14])
    out = runner.step([("a", 7), ("b", 4)])
    steps = [out["a"], out["b"]]
    for _ in range(3):
        for key in ("a", "b"):
            runner.append(key, int(out[key][-1].argmax()))
        out = runner.step([("a", 1), ("b", 1)])
        steps += [out["a"], out["b"]]
    return steps


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_fused_quantization_wiring_gives_the_same_logits(llama):
    plain, cfg = _fp8_model(llama, CpuInvariantOps())
    fusing_ops = _FusingOps()
    fused, _ = _fp8_model(llama, fusing_ops)
    layers = cfg.num_hidden_layers
    assert not any(m.takes_quantized_rows for n, m in plain.named_modules() if n.endswith("_proj"))
    want, got = _run(plain, cfg), _run(fused, cfg)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    steps = 4
    # Per layer and step: both norms and the activation quantize; qkv, gate_up and down take their rows,
    # o_proj (fed by attention) quantizes its own input.
    assert fusing_ops.calls == Counter(norm=2 * layers * steps, act=layers * steps,
                                       quantized_in=3 * layers * steps, bf16_in=layers * steps)


def _fp8_linear(ops, n: int, k: int, group: int):
    """An engine Linear converted to FP8 by hand: e4m3 weight [n, k], row scales [n, ceil(k / group)]."""
    from deepinfer.engine.layers.linear import Linear

    layer = Linear(k, n, False, ops, torch.float32)
    layer.weight = torch.nn.Parameter(torch.ones(n, k).to(torch.float8_e4m3fn), requires_grad=False)
    layer.register_parameter("fp8_scale", torch.nn.Parameter(torch.ones(n, -(-k // group)),
                                                             requires_grad=False))
    layer.fp8_group = group
    return layer


def test_only_rowwise_fp8_layers_take_quantized_rows(llama):
    from deepinfer.engine.layers.linear import Linear

    ops = _FusingOps()
    rowwise, _ = _fp8_model(llama, ops)
    assert all(m.takes_quantized_rows for n, m in rowwise.named_modules() if n.endswith("_proj"))
    assert _fp8_linear(ops, 8, 64, 64).takes_quantized_rows
    assert _fp8_linear(ops, 8, 64, 128).takes_quantized_rows       # one K-group wider than K: rowwise too
    block = _fp8_linear(ops, 8, 64, 16)                              # K-groups: the linear quantizes itself
    assert not block.takes_quantized_rows
    assert not _fp8_linear(CpuInvariantOps(), 8, 64, 64).takes_quantized_rows
    rows = QuantizedActivation(torch.ones(2, 64).to(torch.float8_e4m3fn), torch.ones(2, 1), torch.float32)
    assert torch.equal(_fp8_linear(ops, 8, 64, 64)(rows), torch.full((2, 8), 64.0))
    with pytest.raises(ValueError, match="one weight scale per output channel"):
        block(rows)
    with pytest.raises(ValueError, match="needs an FP8 layer"):
        Linear(64, 4, False, ops, torch.float32)(rows)
