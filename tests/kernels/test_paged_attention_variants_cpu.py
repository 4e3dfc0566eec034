"""Runs tests/kernels/test_paged_attention_variants_interpreted.py (the paged-attention kernel's tile
variants: transposed tiles, decode tiles, the fp16 path of the e4m3 cache) on CPU under Triton's
interpreter, in the TRITON_INTERPRET=1 process that tests/support/interpreted.py starts."""

from __future__ import annotations

from tests.support.interpreted import launches, run_interpreted


@launches("tests/kernels/test_paged_attention_variants_interpreted.py")
def test_paged_attention_variants_pass_under_interpreter(request):
    run_interpreted(request, "paged-attention variant")


@launches("tests/kernels/test_paged_attention_static_plan_interpreted.py")
def test_paged_attention_static_prefill_plan_passes_under_interpreter(request):
    run_interpreted(request, "paged-attention static prefill plan")


@launches("tests/kernels/test_paged_attention_split_interpreted.py")
def test_paged_attention_split_kv_passes_under_interpreter(request):
    run_interpreted(request, "paged-attention split-KV")
