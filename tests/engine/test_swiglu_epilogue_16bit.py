"""The 16-bit SwiGLU-epilogue wiring on CPU: where the backend says so (`Ops.swiglu_in_16bit_gate_up`, the
deterministic CUDA backend's), the loader reorders each MLP's gate_up rows gate j, up j (and its bias) and
the MLP calls `Ops.swiglu_linear` instead of linear + silu_and_mul, with the same logits bit for bit.

CPU runs the shared composition of `swiglu_linear` (linear over the reordered rows, the pairs taken apart,
silu_and_mul), so this checks the reorder, the flag and every load path; the kernel's own equality is
tests/kernels/test_bi_linear_swiglu_interpreted.py's, and the engine on the GPU
tests/engine/test_fp8_fused_quant_gpu.py's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.engine.layers.mlp import GatedMLP

from tests.support.paged_runner import two_prompt_logits


class _SwigluOps(CpuInvariantOps):
    swiglu_in_16bit_gate_up = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def swiglu_linear(self, x, weight, bias=None):
        self.calls["swiglu_linear"] += 1
        return super().swiglu_linear(x, weight, bias)


def _model(path, ops, dtype, dummy: bool, mlp_bias: bool = False):
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import plan_quantization
    from deepinfer.engine.models.quant.fp8_loading import init_dummy_with_plan, load_with_plan
    from deepinfer.engine.models.registry import build_model

    cfg = replace(ModelConfig.from_dir(path), mlp_bias=mlp_bias)
    plan = plan_quantization(None, None, "cpu")
    model = build_model(cfg, ops, dtype, "cpu")
    if dummy:
        init_dummy_with_plan(model, plan, seed=3)
    else:
        load_with_plan(model, iter_weights(path, "cpu"), plan)
    return model, cfg


@pytest.mark.parametrize("dtype,dummy,mlp_bias,reordered", [
    (torch.bfloat16, False, False, True),     # checkpoint weights
    (torch.bfloat16, True, True, True),       # dummy weights, an MLP bias (reordered with the rows)
    (torch.float16, True, False, True),
    (torch.float32, False, False, False),     # float32 keeps linear + silu_and_mul
])
def test_16bit_swiglu_epilogue_wiring_gives_the_same_logits(tiny_checkpoint, dtype, dummy, mlp_bias,
                                                              reordered):
    path = tiny_checkpoint("llama")
    plain, cfg = _model(path, CpuInvariantOps(), dtype, dummy, mlp_bias)
    ops = _SwigluOps()
    fused, _ = _model(path, ops, dtype, dummy, mlp_bias)
    mlps = [m for m in fused.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(m.swiglu_in_gate_up == reordered for m in mlps)
    for a, b in zip(two_prompt_logits(plain, cfg, 2), two_prompt_logits(fused, cfg, 2), strict=True):
        assert torch.equal(a, b)
    assert ops.calls["swiglu_linear"] == (cfg.num_hidden_layers * 3 if reordered else 0)
    if reordered:   # rows (and bias entries) alternate gate j, up j
        name = next(n for n, m in fused.named_modules() if isinstance(m, GatedMLP))
        p, f = dict(plain.named_modules())[name].gate_up_proj, dict(fused.named_modules())[name].gate_up_proj
        i = p.weight.shape[0] // 2
        assert torch.equal(f.weight[0::2], p.weight[:i]) and torch.equal(f.weight[1::2], p.weight[i:])
        if mlp_bias:
            assert torch.equal(f.bias[0::2], p.bias[:i]) and torch.equal(f.bias[1::2], p.bias[i:])


def test_the_reorder_runs_once():
    from deepinfer.engine.models.quant.fp8_loading import reorder_swiglu_gate_up

    mlp = GatedMLP(8, 6, False, _SwigluOps(), torch.bfloat16)
    w = torch.arange(12 * 8, dtype=torch.float32).view(12, 8).to(torch.bfloat16)
    mlp.gate_up_proj.weight.data.copy_(w)
    reorder_swiglu_gate_up(mlp)
    reorder_swiglu_gate_up(mlp)   # already marked: left as it is
    got = mlp.gate_up_proj.weight
    assert torch.equal(got[0::2], w[:6]) and torch.equal(got[1::2], w[6:])
