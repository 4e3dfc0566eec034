"""CPU: the fused-MoE reference against the engine's MoE reference, and the interpreted kernel tests.

tests/kernels/test_fused_moe_interpreted.py needs a process started with TRITON_INTERPRET=1 (Triton decides
at import time whether kernels are compiled or interpreted); this module starts one and fails with its
report when an interpreted test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer.kernels.reference.fused_moe import fused_moe_ref
from deepinfer.kernels.reference.moe import combine_experts, experts_ref

_ROOT = Path(__file__).resolve().parents[2]
_INTERPRETED = _ROOT / "tests" / "kernels" / "test_fused_moe_interpreted.py"


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 already set: pytest collects the interpreted tests directly")
def test_fused_moe_kernels_pass_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(_INTERPRETED)],
                          cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"interpreted fused-MoE tests failed:\n{report}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
