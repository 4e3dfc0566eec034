"""CPU: the fused-MoE reference against the engine's MoE reference, and the interpreted kernel tests.

tests/kernels/test_fused_moe_interpreted.py needs a process started with TRITON_INTERPRET=1 (Triton decides at
import time whether kernels are compiled or interpreted); this module's launcher has
tests/support/interpreted.py start one (shared with the other launchers of the session) and fails when a test
of that file fails.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.fused_moe import fused_moe_ref
from deepinfer.kernels.reference.moe import combine_experts, experts_ref

from tests.support.interpreted import launches, run_interpreted


def test_fused_moe_reference_agrees_with_the_engine_reference():
    gen = torch.Generator().manual_seed(0)
    t, h, inter, experts, top_k = 11, 32, 24, 6, 2
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inter, h, generator=gen, dtype=torch.float64)
    down = torch.randn(experts, h, inter, generator=gen, dtype=torch.float64)
    ids = torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.sort(dim=-1).values
    w = torch.rand(t, top_k, generator=gen)
    engine = combine_experts(experts_ref(x, ids, gate_up, down), w)
    torch.testing.assert_close(fused_moe_ref(x.float(), ids, w, gate_up.float(), down.float()),
                               engine.float(), atol=1e-4, rtol=1e-4)


@launches("tests/kernels/test_fused_moe_interpreted.py")
def test_fused_moe_kernels_pass_under_interpreter(request):
    run_interpreted(request, "fused-MoE")
