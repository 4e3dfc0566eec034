"""Runs the kernel tests of tests/kernels/test_kernels_interpreted.py on CPU under Triton's interpreter.

Triton fixes at import time whether @triton.jit functions (its standard library's included) are compiled
or interpreted, so the interpreted tests need a fresh process started with TRITON_INTERPRET=1; this test
starts it and fails with that run's report when any interpreted test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_INTERPRETED = _ROOT / "tests" / "kernels" / "test_kernels_interpreted.py"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 already set: pytest collects the interpreted tests directly")
def test_triton_kernels_pass_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(_INTERPRETED)],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    report = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{report}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
