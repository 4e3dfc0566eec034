"""Prefill CUDA graphs on CPU (runner/prefill_graphs.py): stand-in replays of the padded forward (the graph
path minus CUDA: token buckets, the padding sequence, empty sequences, static buffers, placeholder inputs
substituted in them, sampling rows gathered from the static output) give the eager engine's outputs, and a
padded step's real rows are the eager step's bits with no cache slot written by padding. The capture
itself and the kernel's static plan on the GPU: tests/engine/test_prefill_graphs_gpu.py; the plan under
Triton's interpreter: tests/kernels/test_paged_attention_static_plan_interpreted.py."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.runner import prefill_graphs
from deepinfer.engine.runner.cuda_graphs import is_decode_step
from deepinfer.engine.runner.prefill_graphs import PrefillGraphs, make_prefill_graphs

from tests.engine.test_overlap import _requests, _view

# (engine settings, first bucket, bucket step): buckets small enough that the tiny model's steps use several
SETTINGS = {
    "chunked_prefill": (dict(num_kv_blocks=512, max_num_batched_tokens=48, max_num_seqs=12), 8, 16),
    "prefix_hits_and_preemption": (dict(num_kv_blocks=16, max_num_seqs=32, max_num_batched_tokens=64),
                                   16, 32),
}


def _stand_in_graphs(llm: LLM, first: int, step: int, block_q: int | None = 4) -> PrefillGraphs:
    runner, sched = llm.engine.runner, llm.sched_cfg
    return PrefillGraphs(runner.model, runner.kv_caches, runner.block_size, sched.max_model_len,
                         sched.max_num_seqs, sched.max_num_batched_tokens, torch.device("cpu"), block_q,
                         first_bucket=first, bucket_step=step, stand_ins=True)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prefill_graph_path_in_the_engine_gives_the_eager_outputs(setting, model_dir):
    kwargs, first, step = SETTINGS[setting]
    llm = LLM(model=model_dir, device="cpu", dtype="float32", **kwargs)
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.executor.prefill_graphs = _stand_in_graphs(llm, first, step)
    for overlap in (True, False):
        llm.engine.async_scheduling = overlap
        assert _view(llm.generate(prompts, params, use_tqdm=False)) == _view(eager)
    stats = llm.get_stats()
    assert stats["prefill_graphs_enabled"] and stats["prefill_graph_steps"] > 0, stats
    assert stats["prefill_graph_padded_tokens"] > 0 and len(stats["prefill_graph_buckets"]) > 1, stats
    if setting == "prefix_hits_and_preemption":
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert any(o.metrics["num_preemptions"] for o in outs)


def test_requests_with_prompt_logprobs_take_the_eager_path(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)
    eager = llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    llm.engine.executor.prefill_graphs = graphs = _stand_in_graphs(llm, 8, 16)
    got = llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    def view(outs):
        return [(o.token_ids, o.prompt_logprobs) for o in outs]

    assert view(got) == view(eager)
    assert graphs.stats.replays == 0


def test_padded_prefill_step_matches_the_eager_rows_and_padding_writes_no_slot(model_dir):
    """A mixed step (two prompts and a decode) padded into a bucket with empty
    sequences and a padding sequence: the sampled rows' hidden states are the eager step's bits, the
    padding wrote no cache slot, and the eager step wrote the same cache entries."""
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=6,
              max_num_batched_tokens=40)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add(llm._make_seq(0, [5, 6, 7], greedy))
    engine.step()   # its prefill: a decode row in the next step
    for i, p in enumerate(([11] * 20, [9, 8, 7, 6, 5]), start=1):
        engine.add(llm._make_seq(i, p, greedy))
    out = engine.scheduler.schedule()
    assert not is_decode_step(out) and len(out.scheduled) == 3 and out.num_batched_tokens == 26
    graphs = _stand_in_graphs(llm, 16, 48)   # buckets 16, 32, 40: this step takes 32 (6 padding tokens)
    runner = engine.runner
    bs = runner.block_size
    real_slots = {s.seq.block_table[p // bs] * bs + p % bs
                  for s in out.scheduled for p in range(s.start, s.start + s.num_new_tokens)}
    with torch.inference_mode():
        before = [c[0].flatten(0, 1).clone() for c in runner.kv_caches]
        padded = graphs.run(out, [], None).clone()
        after_padded = [c[0].flatten(0, 1).clone() for c in runner.kv_caches]
        eager = engine.executor.forward(out).hidden
    assert graphs.buckets == [16, 32, 40] and graphs.stats.buckets == [32] and graphs.stats.padded_rows == 6
    assert torch.equal(padded, eager) and torch.isfinite(padded).all()
    for old, new, cache in zip(before, after_padded, runner.kv_caches, strict=True):
        changed = set((old != new).any(-1).any(-1).nonzero().flatten().tolist())
        assert changed and changed <= real_slots     # the padding tokens wrote no cache slot
        assert torch.equal(cache[0].flatten(0, 1), new)
    engine.abort_all()


def test_prefill_graphs_are_cuda_only_and_can_be_switched_off(model_dir, monkeypatch):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    r = llm.engine.runner
    args = (r.model, r.kv_caches, r.block_size, 64, 4, 64)
    assert make_prefill_graphs(*args, torch.device("cpu"), True) is None   # CPU: never
    assert llm.get_stats()["prefill_graphs_enabled"] is False
    # Where graphs are supported they are on unless switched off (or graphs are off altogether).
    monkeypatch.setattr(prefill_graphs, "graphs_supported", lambda model, device: True)
    assert isinstance(make_prefill_graphs(*args, torch.device("cpu"), True), PrefillGraphs)
    assert make_prefill_graphs(*args, torch.device("cpu"), False) is None
    for switch in ("DEEPINFER_DISABLE_PREFILL_GRAPHS", "DEEPINFER_DISABLE_CUDA_GRAPHS"):
        monkeypatch.setenv(switch, "1")
        assert make_prefill_graphs(*args, torch.device("cpu"), True) is None, switch
        monkeypatch.delenv(switch)


@pytest.mark.parametrize("split_graphs", [False, True])
def test_steps_with_rows_past_the_split_threshold_take_split_graphs_or_run_eagerly(model_dir, split_graphs):
    """A step with a row past the split threshold replays its bucket's split graph (metadata marked split_kv:
    programs that merge their rows' ranges) where the prefill tile merges in place; on the other tiles the
    kernel plans split programs from the rows' lengths, which a graph cannot replay, so the step runs
    eagerly. The other steps take the plain graphs either way, and the outputs keep their bits."""
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=48,
              max_num_seqs=12)
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = llm.generate(prompts, params, use_tqdm=False)
    graphs = _stand_in_graphs(llm, 8, 16)
    graphs.split_from, graphs.split_graphs = 75, split_graphs   # rows end at 55..83 in these steps
    llm.engine.executor.prefill_graphs = graphs
    seen, metas = [], []
    fits, forward = graphs.fits, graphs._forward

    def record_fits(out):   # (furthest position a prefill or mixed step reaches, whether it took a graph)
        ok = fits(out)
        if not is_decode_step(out):
            seen.append((max(s.start + s.num_new_tokens for s in out.scheduled), ok))
        return ok

    graphs.fits = record_fits
    graphs._forward = lambda bucket, split: metas.append(split) or forward(bucket, split)
    assert _view(llm.generate(prompts, params, use_tqdm=False)) == _view(eager)
    assert graphs.stats.replays > 0 and graphs.stats.buckets
    assert any(end > 75 for end, _ in seen) and any(ok for end, ok in seen if end <= 75)
    assert all(ok == split_graphs for end, ok in seen if end > 75)
    assert bool(graphs.stats.split_buckets) == split_graphs == (True in metas)
    assert llm.get_stats()["prefill_graph_split_buckets"] == graphs.stats.split_buckets


@pytest.mark.parametrize("env,split_graphs", [(None, True), ("1", False)])
def test_split_graphs_follow_the_prefill_tile_and_can_be_switched_off(model_dir, monkeypatch, env,
                                                                       split_graphs):
    """make_prefill_graphs turns split graphs on where the prefill tile merges in place (the float32 tile
    here), unless $DEEPINFER_EAGER_SPLIT_PREFILL=1."""
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    r = llm.engine.runner
    if env is not None:
        monkeypatch.setenv(prefill_graphs.EAGER_SPLIT_ENV, env)
    monkeypatch.setattr(prefill_graphs, "graphs_supported", lambda model, device: True)
    graphs = make_prefill_graphs(r.model, r.kv_caches, r.block_size, 64, 4, 64, torch.device("cpu"), True)
    assert graphs.split_from is not None and graphs.split_graphs is split_graphs
