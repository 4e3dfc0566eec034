"""Runs tests/kernels/test_sampling_interpreted.py on CPU under Triton's interpreter (a fresh process with
TRITON_INTERPRET=1, since Triton decides at import time whether @triton.jit functions are interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_INTERPRETED = _ROOT / "tests" / "kernels" / "test_sampling_interpreted.py"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 already set: pytest collects the interpreted tests directly")
def test_sampling_kernel_passes_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(_INTERPRETED)],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    report = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"interpreted sampling-kernel tests failed:\n{report}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout and "skipped" not in proc.stdout, report
