"""CPU: the absorbed-MLA reference against the expanded one, and the interpreted MLA kernel tests.

tests/kernels/test_mla_decode_interpreted.py needs a process started with TRITON_INTERPRET=1 (Triton decides
at import time whether kernels are compiled or interpreted); this module's launcher has
tests/support/interpreted.py start one (shared with the other launchers of the session) and fails when a test
of that file fails.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.mla import mla_attention_ref, split_kv_b
from deepinfer.kernels.reference.mla_decode import head_proj_ref, mla_decode_ref

from tests.support.interpreted import launches, run_interpreted
from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists


def test_absorbed_reference_equals_expanded_attention():
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, v, rank, bs = 3, 8, 4, 6, 16, 16
    lens = [21, 40]
    blocks, num_blocks = random_block_lists(lens, bs)
    cache = torch.randn(num_blocks, bs, rank + rope, generator=gen, dtype=torch.float32)
    meta = build_metadata([SeqStep(blocks[0], 21, 21), SeqStep(blocks[1], 40, 5)], bs)
    t = meta.num_tokens
    q_nope = torch.randn(t, heads, nope, generator=gen, dtype=torch.float32)
    q_pe = torch.randn(t, heads, rope, generator=gen, dtype=torch.float32)
    kv_b = torch.randn(heads * (nope + v), rank, generator=gen, dtype=torch.float32)
    w_uk, w_uv = split_kv_b(kv_b, heads, nope)
    q_abs = torch.cat([head_proj_ref(q_nope, w_uk.transpose(1, 2)), q_pe], dim=-1)
    got = head_proj_ref(mla_decode_ref(q_abs, cache, meta, 0.3, rank), w_uv)
    want = mla_attention_ref(q_nope, q_pe, cache, meta, kv_b, 0.3, absorb_decode=False)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@launches("tests/kernels/test_mla_decode_interpreted.py")
def test_mla_kernels_pass_under_interpreter(request):
    run_interpreted(request, "MLA kernel")


@launches("tests/kernels/test_mla_static_decode_interpreted.py")
def test_mla_static_decode_plan_passes_under_interpreter(request):
    run_interpreted(request, "MLA static decode plan")
