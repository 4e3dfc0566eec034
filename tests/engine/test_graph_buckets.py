"""CUDA-graph decode inputs on CPU: bucket choice, padding values, static buffers, placeholder inputs, and the
padded decode forward giving a real row the eager forward's bits (the graph itself needs CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs, is_decode_step
from deepinfer.engine.runner.input_buffers import (
    PAD_SLOT,
    DecodeRow,
    StaticDecodeBuffers,
    decode_plan,
    graph_buckets,
    pad_decode,
    pick_bucket,
)
from deepinfer.engine.runner.step_executor import SampledTokens, pending_inputs

from tests.support.graph_checks import check_padded_decode_step


def test_buckets_cover_every_batch_up_to_the_cap():
    assert graph_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_buckets(7) == [1, 2, 4, 7]
    assert graph_buckets(1) == [1]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1000, max_graph_batch=64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError):
        graph_buckets(0)
    buckets = graph_buckets(100)
    for n in range(1, 101):
        b = pick_bucket(buckets, n)
        assert b is not None and b >= n and b - n < 16
        assert all(x < n for x in buckets if x < b)    # the smallest that fits
    assert pick_bucket(buckets, 101) is None and pick_bucket(buckets, 0) is None


def test_padding_rows_write_no_slot_and_read_block_zero():
    rows = [DecodeRow(11, 5, [3]), DecodeRow(PENDING_TOKEN, 17, [7, 9]), DecodeRow(13, 0, [4])]
    step = pad_decode(rows, bucket=4, block_size=16)
    assert step.num_real == 3 and step.bucket == 4
    assert step.input_ids.tolist() == [11, PENDING_TOKEN, 13, 0]
    assert step.positions.tolist() == [5, 17, 0, 0]
    assert step.slot_mapping.tolist() == [3 * 16 + 5, 9 * 16 + 1, 4 * 16 + 0, PAD_SLOT]
    assert step.seq_lens.tolist() == [6, 18, 1, 1]
    assert step.block_tables.tolist() == [[3, 0], [7, 9], [4, 0], [0, 0]]
    with pytest.raises(ValueError, match="past its"):
        pad_decode([DecodeRow(1, 16, [3])], bucket=1, block_size=16)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode(rows, bucket=2, block_size=16)


def test_decode_plan_maps_program_b_to_sequence_b():
    assert decode_plan(3).tolist() == [0, 0, 1, 0, 2, 0]


def test_static_buffers_take_a_step_and_keep_constant_parts():
    buf = StaticDecodeBuffers(max_batch=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    buf.load(pad_decode([DecodeRow(1, 40, [5, 6, 8]), DecodeRow(2, 3, [2])], bucket=2, block_size=16))
    assert buf.block_tables.tolist() == [[5, 6, 8], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    buf.load(pad_decode([DecodeRow(3, 1, [4])], bucket=1, block_size=16))
    # Only the columns in use are written; the stale ones are valid block ids past the row's position.
    assert buf.block_tables[0].tolist() == [4, 6, 8]
    assert buf.input_ids[:1].tolist() == [3] and buf.slot_mapping[:2].tolist() == [4 * 16 + 1, 2 * 16 + 3]
    assert buf.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert buf.plan.tolist() == decode_plan(4).tolist()
    with pytest.raises(ValueError, match="exceeds"):
        buf.load(pad_decode([DecodeRow(1, 0, [1, 2, 3, 4])], bucket=1, block_size=16))


def _seq(i: int, prompt: list[int], out: list[int], computed: int, table: list[int]) -> Sequence:
    s = Sequence(seq_id=i, prompt_token_ids=prompt, params=SamplingParams(), seed=0)
    s.output_token_ids = list(out)
    s.num_computed_tokens = computed
    s.block_table = table
    return s


def test_placeholder_inputs_point_at_the_previous_steps_rows():
    a = _seq(0, [1, 2, 3], [4, PENDING_TOKEN], 4, [0])      # decode of its pending token
    b = _seq(1, [5, 6], [], 0, [1])                          # a prefill: nothing pending
    c = _seq(2, [7] * 5, [8, PENDING_TOKEN], 0, [2])         # recomputed after preemption, pending last
    out = SchedulerOutput([ScheduledSequence(a, 4, 1, True), ScheduledSequence(b, 0, 2, True),
                           ScheduledSequence(c, 0, 7, True)])
    prev = SampledTokens([2, 9, 0], torch.tensor([70, 90, 40]), [None] * 3, None, None)
    assert pending_inputs(out, prev) == [(0, 2), (3 + 6, 0)]
    assert not is_decode_step(out)
    assert is_decode_step(SchedulerOutput([ScheduledSequence(a, 4, 1, True)]))
    with pytest.raises(RuntimeError, match="no step in flight"):
        pending_inputs(out, None)


def test_padded_decode_forward_matches_the_eager_rows_bit_for_bit(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    check_padded_decode_step(llm, lambda layer: layer[0].flatten(0, 1))   # (k, v): k's rows by slot


def test_graph_path_in_the_engine_gives_the_eager_outputs(model_dir):
    """The engine with stand-in replays (graph path minus CUDA: buckets, padding, static output reused
    every step, placeholder inputs substituted in the static buffers) against the eager engine."""
    from tests.engine.test_overlap import _requests, _view

    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=40, max_num_seqs=12,
              max_num_batched_tokens=48)
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 512, 12, torch.device("cpu"))
    graphs.stand_in_replays()
    llm.engine.executor.graphs = graphs
    for overlap in (True, False):
        llm.engine.async_scheduling = overlap
        assert _view(llm.generate(prompts, params, use_tqdm=False)) == _view(eager)
    stats = llm.get_stats()
    assert stats["graph_steps"] > 0 and stats["cuda_graph_padded_rows"] > 0, stats


def _steps(rng_seed: int) -> list:
    rng = random.Random(rng_seed)
    steps = []
    for _ in range(12):
        n = rng.randint(1, 6)
        rows = []
        for _ in range(n):
            k = rng.randint(1, 3)
            rows.append(DecodeRow(rng.randrange(0, 99), rng.randrange(0, 16 * k), [rng.randrange(0, 50)
                                                                                   for _ in range(k)]))
        steps.append(pad_decode(rows, bucket=rng.choice([b for b in (1, 2, 4, 8) if b >= n]), block_size=16))
    return steps


def _expected_after(steps: list, max_batch: int, width: int) -> dict[str, list]:
    """What per-field copies of each step's rows leave in the buffers (the earlier load's semantics)."""
    ids, pos, slots = [0] * max_batch, [0] * max_batch, [-1] * max_batch
    lens, tables = [1] * max_batch, [[0] * width for _ in range(max_batch)]
    for st in steps:
        for b in range(st.bucket):
            ids[b], pos[b], slots[b] = int(st.input_ids[b]), int(st.positions[b]), int(st.slot_mapping[b])
            lens[b] = int(st.seq_lens[b])
            w = st.block_tables.shape[1]
            tables[b][:w] = st.block_tables[b].tolist()
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "seq_lens": lens,
            "block_tables": tables}


def _device_state(buf: StaticDecodeBuffers) -> dict[str, list]:
    return {k: getattr(buf, k).cpu().tolist()
            for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")}


@pytest.mark.parametrize("seed", range(3))
def test_packed_load_equals_per_field_copies(seed):
    steps = _steps(seed)
    buf = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=3, device=torch.device("cpu"))
    for i in range(len(steps)):
        buf.load(steps[i])
        assert _device_state(buf) == _expected_after(steps[: i + 1], 8, 3)
        assert buf.input_ids.dtype == torch.int64 and buf.seq_lens.dtype == torch.int32


@pytest.mark.gpu
def test_packed_load_on_cuda_through_the_staging_ring():
    steps = _steps(7)
    buf = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=3, device=torch.device("cuda"))
    for i in range(len(steps)):
        buf.load(steps[i])
        torch.cuda.synchronize()
        assert _device_state(buf) == _expected_after(steps[: i + 1], 8, 3)
