"""GPU: the fused MoE kernels at a DeepSeek-V2-Lite expert shape against the float32 reference, and a
token's output bitwise identical whatever other tokens share the call (and its experts)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fused_moe import fused_moe_ref

from tests.support.moe_inputs import expert_weights, routed_tokens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 64, 6, 2048, 1408


@pytest.fixture(scope="module")
def weights():
    return expert_weights(EXPERTS, HIDDEN, INTER, CUDA)


def _tokens(n, seed, skew=False):
    return routed_tokens(n, seed, HIDDEN, EXPERTS, TOP_K, CUDA, skew)


@pytest.mark.parametrize("n,skew", [(1, False), (37, False), (300, True)])
def test_fused_moe_matches_reference(weights, n, skew):
    from deepinfer.kernels.fused_moe import fused_moe

    x, ids, w = _tokens(n, seed=n, skew=skew)
    ref = fused_moe_ref(x, ids, w, *weights)
    for invariant in (True, False):          # fast mode takes 16-row blocks for n = 1 and 37
        got = fused_moe(x, ids, w, *weights, invariant=invariant)
        # bf16 intermediate h (rounded before the down GEMM) and output: a few bf16 ulps of outputs ~O(1).
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_fused_moe_token_bits_do_not_depend_on_other_tokens(weights):
    from deepinfer.kernels.fused_moe import fused_moe

    x, ids, w = _tokens(400, seed=7, skew=True)
    full = fused_moe(x, ids, w, *weights)
    gen = torch.Generator().manual_seed(1)
    for size in (1, 7, 33, 129):
        for _ in range(3):
            pick = torch.randperm(400, generator=gen)[:size].to(CUDA)
            part = fused_moe(x[pick], ids[pick], w[pick], *weights)
            assert torch.equal(part, full[pick]), f"batch of {size}"
    # the same token beside tokens that all chose its experts (its rows move within the blocks)
    crowd_ids = ids[:1].expand(90, -1).contiguous()
    crowd_x = torch.cat([x[:1], torch.randn(89, HIDDEN, device=CUDA).bfloat16()])
    crowd = fused_moe(crowd_x, crowd_ids, w[:1].expand(90, -1).contiguous(), *weights)
    assert torch.equal(crowd[0], full[0])


@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (128, 64), (4097, 8), (33, 160)])
def test_row_sum_in_order_gives_the_torch_loops_bits_on_the_device(rows, cols):
    """The routers' one-launch row sum (kernels/row_sum.py) against their torch loop on the GPU, and a
    router's softmax through the CUDA backend against the shared (torch) one: the same bits."""
    from deepinfer.engine.layers.cuda_ops import CudaInvariantOps
    from deepinfer.kernels.reference.moe import route_softmax, sum_last_in_order
    from deepinfer.kernels.row_sum import row_sum_in_order

    gen = torch.Generator(device=CUDA).manual_seed(rows)
    x = torch.randn(rows, cols, device=CUDA, generator=gen).exp() * 1e3
    assert torch.equal(row_sum_in_order(x), sum_last_in_order(x))
    logits = torch.randn(rows, cols, device=CUDA, generator=gen)
    ours = route_softmax(logits, 6 if cols >= 6 else 1, "greedy", None, None, 1.0, invariant=True,
                         sum_last=CudaInvariantOps().sum_last_in_order)
    shared = route_softmax(logits, 6 if cols >= 6 else 1, "greedy", None, None, 1.0, invariant=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, shared, strict=True))
