"""kernels/fused_moe.py's clipped-SwiGLU variant (`swiglu_limit`) on CPU under Triton's interpreter.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_fused_moe_clipped_cpu.py starts
one). float32: agreement with kernels/reference/fused_moe.py at a limit that clips many pre-activations
(tile tails, an expert spanning several row blocks, both tile modes), and a limit nothing reaches giving the
unclipped kernel's bits exactly. bfloat16 (interpreter patched to the GPU's bf16 dot and rounding): at least
as precise as the engine's CPU path (transformers' rounding). Bitwise batch invariance is checked on the GPU
(test_fused_moe_clipped_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fused_moe import clip_gate_up, fused_moe_ref
from deepinfer.kernels.reference.moe import combine_experts, experts_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fused_moe_clipped_cpu.py")


@pytest.fixture(scope="module")
def moe():
    return interpreted_kernels("fused_moe", "_gate_up_kernel")


def _case(t, h, inter, experts, top_k, seed, skew=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, h, generator=gen) / h ** 0.5
    down = torch.randn(experts, h, inter, generator=gen) / inter ** 0.5
    scores = torch.rand(t, experts, generator=gen)
    if skew:                                       # most tokens on expert 1: a run of several row blocks
        scores[: t * 3 // 4, 1] += 2.0
    ids = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values
    w = torch.rand(t, top_k, generator=gen) + 0.1
    return x.to(dtype), ids, w, gate_up.to(dtype), down.to(dtype)


def _clipped_share(x, ids, gate_up, limit):
    """Fractions of the chosen experts' gate (above limit) and up (outside +-limit) pre-activations."""
    inter = gate_up.shape[1] // 2
    pre = torch.einsum("th,tkih->tki", x.float(), gate_up.float()[ids])
    gate_share = (pre[..., :inter] > limit).float().mean().item()
    return gate_share, (pre[..., inter:].abs() > limit).float().mean().item()


@pytest.mark.parametrize("t,h,inter,experts,top_k,skew", [
    (1, 64, 32, 4, 2, False),
    (23, 48, 40, 6, 3, True),       # tails in N and K; one expert spans two row blocks
])
def test_clipped_fused_moe_matches_reference(moe, t, h, inter, experts, top_k, skew):
    limit = 0.6
    x, ids, w, gate_up, down = _case(t, h, inter, experts, top_k, seed=t, skew=skew)
    gate_share, up_share = _clipped_share(x, ids, gate_up, limit)
    assert gate_share > 0.15 and up_share > 0.3, (gate_share, up_share)      # the clamp really works here
    ref = fused_moe_ref(x, ids, w, gate_up, down, swiglu_limit=limit)
    plain = fused_moe_ref(x, ids, w, gate_up, down)
    assert (ref - plain).abs().max() > 1e-2
    for invariant in (True, False):        # fast mode: 16-row blocks for these small batches
        got = moe.fused_moe(x, ids, w, gate_up, down, invariant=invariant, swiglu_limit=limit)
        assert got.shape == (t, h) and not got.isnan().any()
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_a_limit_nothing_reaches_gives_the_unclipped_bits(moe):
    x, ids, w, gate_up, down = _case(9, 48, 40, 6, 2, seed=3)
    plain = moe.fused_moe(x, ids, w, gate_up, down)
    assert torch.equal(moe.fused_moe(x, ids, w, gate_up, down, swiglu_limit=1e30), plain)
    assert not torch.equal(moe.fused_moe(x, ids, w, gate_up, down, swiglu_limit=0.3), plain)


def test_bf16_clipped_fused_moe_is_as_precise_as_transformers_expert_loop(moe, monkeypatch):
    """bf16: the kernel clamps its fp32 accumulators and rounds h once; the engine's CPU path (as
    transformers) rounds gate and up to bf16 before clamping, then silu and the product: the kernel is no
    further from the exact float32 result."""
    gpu_like_bf16(monkeypatch)
    bf, limit = torch.bfloat16, 0.75
    x, ids, w, gate_up, down = _case(23, 64, 40, 6, 2, seed=8, dtype=bf)
    exact = fused_moe_ref(x.float(), ids, w, gate_up.float(), down.float(), swiglu_limit=limit)

    def hf_act(h):
        gate, up = clip_gate_up(h, limit).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    hf_like = (combine_experts(experts_ref(x, ids, gate_up, down, act=hf_act), w).float() - exact).abs()
    for invariant in (True, False):
        got = moe.fused_moe(x, ids, w, gate_up, down, invariant=invariant, swiglu_limit=limit)
        assert got.dtype == bf
        err = (got.float() - exact).abs()
        assert err.mean() <= hf_like.mean() and err.max() <= hf_like.max(), (err.max(), hf_like.max())


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan")])
def test_fused_moe_rejects_a_bad_limit(moe, bad):
    x, ids, w, gate_up, down = _case(3, 16, 8, 4, 2, seed=0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe.fused_moe(x, ids, w, gate_up, down, swiglu_limit=bad)
