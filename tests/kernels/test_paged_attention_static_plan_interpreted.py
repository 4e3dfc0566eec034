"""The paged-attention kernel over a CUDA-graph prefill step's static plan (engine/runner/prefill_inputs.py)
under Triton's interpreter (a TRITON_INTERPRET=1 subprocess started by
tests/kernels/test_paged_attention_variants_cpu.py): a step padded into a bucket (empty sequences, the
padding sequence at position 0, programs that store nothing up to the plan's capacity) gives the real rows
exactly the bits of the same step run with the host plan, whatever the bucket and max_seqs, also for rows
past the split threshold in a graph captured for them (split_kv: programs that merge their rows' ranges); a
plan built for another BLOCK_Q, and split rows on a tile that does not merge in place, are refused."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.runner.prefill_inputs import StaticPrefillBuffers, pad_prefill, prefill_graph_metadata
from deepinfer.kernels.split_plan import SplitPolicy

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import filled_step, host_step_of

skip_unless_interpreting("tests/kernels/test_paged_attention_variants_cpu.py")

BS, HQ, HKV, D = 16, 8, 2, 16
LENS = [(37, 5), (20, 20), (70, 1), (1, 1), (40, 33)]   # (context, new tokens): prefix hit, prefill, decodes
SPLIT = SplitPolicy(min_tiles=2, max_splits=3)   # 32-key float32 tiles: rows at 64.. (the 70-token row) split


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


def _static(pa, step, bucket: int, max_seqs: int, block_q: int, split_kv: bool):
    """The step padded into `bucket` on the static plan: (query, metadata)."""
    meta, q, _, _ = step
    buf = StaticPrefillBuffers(256, max_seqs, 8, block_q, torch.device("cpu"))
    buf.load(pad_prefill(host_step_of(meta), bucket, max_seqs, block_q))
    qp = torch.randn(bucket, HQ, D, generator=torch.Generator().manual_seed(1))
    qp[: meta.num_tokens] = q
    return qp, prefill_graph_metadata(buf, bucket, BS, split_kv=split_kv)


@pytest.mark.parametrize("bucket,max_seqs", [(62, 5), (200, 8)])
def test_split_rows_on_the_static_plan_give_the_host_plans_bits(pa, step, bucket, max_seqs):
    meta, q, kc, vc = step
    cfg = pa.attention_tile_config(HQ // HKV, D, q.dtype, decode=False)
    assert cfg["MERGE_IN_PLACE"]
    n = meta.num_tokens

    def run(q_, meta_, split):
        return pa.launch_paged_attention(q_, kc, vc, meta_, 0.3, None, None, cfg, split=split)

    eager, whole = run(q, meta, SPLIT), run(q, meta, None)
    long_rows = meta.positions >= 64
    assert long_rows.any() and not torch.equal(eager[long_rows], whole[long_rows])   # they did split
    qp, split_meta = _static(pa, step, bucket, max_seqs, cfg["BLOCK_Q"], split_kv=True)
    assert torch.equal(run(qp, split_meta, SPLIT)[:n], eager)
    qp, plain_meta = _static(pa, step, bucket, max_seqs, cfg["BLOCK_Q"], split_kv=False)
    assert torch.equal(run(qp, plain_meta, SPLIT)[:n], whole)   # a plain graph never splits


def test_split_rows_on_the_static_plan_need_a_tile_that_merges_in_place(pa, step):
    meta, q, kc, vc = step
    cfg = dict(pa.attention_tile_config(HQ // HKV, D, q.dtype, decode=False), MERGE_IN_PLACE=0)
    qp, split_meta = _static(pa, step, 64, 5, cfg["BLOCK_Q"], split_kv=True)
    with pytest.raises(ValueError, match="MERGE_IN_PLACE"):
        pa.launch_paged_attention(qp, kc, vc, split_meta, 0.3, None, None, cfg, split=SPLIT)
