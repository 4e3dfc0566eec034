"""Runs tests/kernels/test_bi_linear_swiglu_interpreted.py on CPU under Triton's interpreter (a fresh process
with TRITON_INTERPRET=1; tests/support/interpreted.py starts it)."""

from __future__ import annotations

from tests.support.interpreted import launches, run_interpreted


@launches("tests/kernels/test_bi_linear_swiglu_interpreted.py")
def test_swiglu_gemm_epilogue_passes_under_interpreter(request):
    run_interpreted(request, "SWIGLU GEMM epilogue", allow_skips=False)
