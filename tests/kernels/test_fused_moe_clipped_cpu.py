"""CPU: the fused MoE's clipped-SwiGLU variant (DeepSeek-V4's `swiglu_limit`), its reference against
transformers' DeepseekV4Experts and the engine's CPU path, and the interpreted kernel tests.

tests/kernels/test_fused_moe_clipped_interpreted.py runs in a TRITON_INTERPRET=1 process that this module's
launcher has tests/support/interpreted.py start (one process shared with the session's other launchers).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.kernels.reference.fused_moe import check_swiglu_limit, clip_gate_up, fused_moe_ref

from tests.support.interpreted import launches, run_interpreted
from tests.support.tiny_deepseek_v4 import hf_v4_available

T, H, INTER, EXPERTS, TOP_K, LIMIT = 13, 32, 24, 6, 2, 0.5


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, H, generator=gen) / H ** 0.5
    down = torch.randn(EXPERTS, H, INTER, generator=gen) / INTER ** 0.5
    ids = torch.rand(T, EXPERTS, generator=gen).topk(TOP_K, dim=-1).indices.sort(dim=-1).values
    w = torch.rand(T, TOP_K, generator=gen) + 0.1
    return x, ids, w, gate_up, down


def test_clip_gate_up_clamps_gate_from_above_and_up_both_ways():
    h = torch.tensor([[-3.0, 0.2, 3.0, -3.0, -3.0, 0.2, 3.0, float("nan")]])   # gate | up, 4 each
    got = clip_gate_up(h, 0.5)
    want = torch.tensor([[-3.0, 0.2, 0.5, -3.0, -0.5, 0.2, 0.5, float("nan")]])
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.skipif(not hf_v4_available(), reason="transformers has no DeepseekV4")
def test_clipped_reference_matches_transformers_experts():
    """fused_moe_ref(swiglu_limit) against transformers' own DeepseekV4Experts (its _apply_gate clamp),
    float32, with a limit small enough that many gate and up pre-activations are clipped."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    x, ids, w, gate_up, down = _case()
    cfg = DeepseekV4Config(hidden_size=H, intermediate_size=INTER, n_routed_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, swiglu_limit=LIMIT)
    hf = DeepseekV4Experts(cfg).eval()
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up)
        hf.down_proj.copy_(down)
        want = hf(x, ids, w)
    pre = torch.einsum("th,eih->tei", x, gate_up)
    assert (pre[..., :INTER] > LIMIT).float().mean() > 0.2
    assert (pre[..., INTER:].abs() > LIMIT).float().mean() > 0.4
    got = fused_moe_ref(x, ids, w, gate_up, down, swiglu_limit=LIMIT)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unclipped = fused_moe_ref(x, ids, w, gate_up, down)
    assert (unclipped - want).abs().max() > 1e-2          # the limit really changes the result here


def test_engine_cpu_path_matches_the_clipped_reference():
    """Ops.routed_experts(swiglu_limit) on CPU (experts_ref + combine_experts, the path V4MoE takes there)."""
    x, ids, w, gate_up, down = _case(seed=1)
    got = CpuInvariantOps().routed_experts(x, ids, w, gate_up, down, swiglu_limit=LIMIT)
    torch.testing.assert_close(got, fused_moe_ref(x, ids, w, gate_up, down, swiglu_limit=LIMIT),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "10"])
def test_swiglu_limit_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="swiglu_limit"):
        check_swiglu_limit(bad)
    x, ids, w, gate_up, down = _case()
    with pytest.raises(ValueError, match="swiglu_limit"):
        fused_moe_ref(x, ids, w, gate_up, down, swiglu_limit=bad)


@launches("tests/kernels/test_fused_moe_clipped_interpreted.py")
def test_clipped_fused_moe_kernels_pass_under_interpreter(request):
    run_interpreted(request, "clipped fused-MoE")
