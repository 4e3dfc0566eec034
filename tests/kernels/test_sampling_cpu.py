"""Runs tests/kernels/test_sampling_interpreted.py on CPU under Triton's interpreter (a fresh process with
TRITON_INTERPRET=1, since Triton decides at import time whether @triton.jit functions are interpreted;
tests/support/interpreted.py starts it)."""

from __future__ import annotations

from tests.support.interpreted import launches, run_interpreted


@launches("tests/kernels/test_sampling_interpreted.py")
def test_sampling_kernel_passes_under_interpreter(request):
    run_interpreted(request, "sampling-kernel", allow_skips=False)


@launches("tests/kernels/test_sampling_filter_interpreted.py")
def test_filter_sampling_kernel_passes_under_interpreter(request):
    run_interpreted(request, "filter-sampling-kernel", allow_skips=False)


@launches("tests/kernels/test_penalties_interpreted.py")
def test_penalty_kernel_passes_under_interpreter(request):
    run_interpreted(request, "penalty-kernel", allow_skips=False)
