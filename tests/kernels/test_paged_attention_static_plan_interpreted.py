"""The paged-attention kernel over a CUDA-graph prefill step's static plan (engine/runner/prefill_inputs.py)
under Triton's interpreter (a TRITON_INTERPRET=1 subprocess started by
tests/kernels/test_paged_attention_variants_cpu.py): a step padded into a bucket (empty sequences, the
padding sequence at position 0, programs that store nothing up to the plan's capacity) gives the real rows
exactly the bits of the same step run with the host plan, whatever the bucket and max_seqs; a plan built
for another BLOCK_Q is refused."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.runner.prefill_inputs import StaticPrefillBuffers, pad_prefill, prefill_graph_metadata

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import filled_step, host_step_of

skip_unless_interpreting("tests/kernels/test_paged_attention_variants_cpu.py")

BS, HQ, HKV, D = 16, 8, 2, 16
LENS = [(37, 5), (20, 20), (70, 1), (1, 1), (40, 33)]   # (context, new tokens): prefix hit, prefill, decodes


@pytest.fixture(scope="module")
def pa():
    return interpreted_kernels("paged_attention")


@pytest.fixture(scope="module")
def step():
    """A NaN-filled float32 cache (block 0 included: the padding rows read it) holding every context, the
    step's metadata and query."""
    gen = torch.Generator().manual_seed(5)
    st = filled_step(LENS, BS, HKV, D, gen, table_seed=9, key_scale=2)
    q = torch.randn(st.meta.num_tokens, HQ, D, generator=gen)
    return st.meta, q, st.k_cache, st.v_cache


@pytest.mark.parametrize("bucket,max_seqs", [(62, 5), (64, 8), (200, 5), (256, 40)])
def test_padded_step_on_the_static_plan_gives_the_host_plans_bits(pa, step, bucket, max_seqs):
    meta, q, kc, vc = step
    eager = pa.paged_attention(q, kc, vc, meta, 0.3)
    block_q = pa.attention_tile_config(HQ // HKV, D, q.dtype, decode=False)["BLOCK_Q"]
    buf = StaticPrefillBuffers(256, max_seqs, 8, block_q, torch.device("cpu"))
    buf.load(pad_prefill(host_step_of(meta), bucket, max_seqs, block_q))
    padded_meta = prefill_graph_metadata(buf, bucket, BS)
    qp = torch.randn(bucket, HQ, D, generator=torch.Generator().manual_seed(1))
    qp[: meta.num_tokens] = q
    out = pa.paged_attention(qp, kc, vc, padded_meta, 0.3)
    assert not eager.isnan().any()
    assert torch.equal(out[: meta.num_tokens], eager)


def test_a_plan_of_other_query_blocks_is_refused(pa, step):
    meta, q, kc, vc = step
    block_q = pa.attention_tile_config(HQ // HKV, D, q.dtype, decode=False)["BLOCK_Q"]
    buf = StaticPrefillBuffers(64, 5, 8, block_q + 1, torch.device("cpu"))
    buf.load(pad_prefill(host_step_of(meta), 64, 5, block_q + 1))
    qp = torch.zeros(64, HQ, D)
    with pytest.raises(ValueError, match="prefill_plan was built for BLOCK_Q"):
        pa.paged_attention(qp, kc, vc, prefill_graph_metadata(buf, 64, BS), 0.3)
