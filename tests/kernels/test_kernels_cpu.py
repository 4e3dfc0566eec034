"""Runs the kernel tests of tests/kernels/test_kernels_interpreted.py on CPU under Triton's interpreter.

Triton fixes at import time whether @triton.jit functions (its standard library's included) are compiled
or interpreted, so the interpreted tests need a fresh process started with TRITON_INTERPRET=1;
tests/support/interpreted.py starts it (one for every interpreted file the session collected) and this test
fails with that run's report when any test of test_kernels_interpreted.py fails.
"""

from __future__ import annotations

from tests.support.interpreted import launches, run_interpreted


@launches("tests/kernels/test_kernels_interpreted.py")
def test_triton_kernels_pass_under_interpreter(request):
    run_interpreted(request, "kernel")
