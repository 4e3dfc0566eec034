"""Lazy CUDA-graph capture: a bucket is made on the first decode step that needs it, from that step's real
staged inputs, and the outputs keep the eager engine's bits. CPU: eager stand-ins made lazily (the
bookkeeping and the warm-up-on-real-inputs claim); GPU: real lazy capture vs start-up capture, bitwise."""

from __future__ import annotations

import gc

import pytest
import torch
from deepinfer.engine import LLM
from deepinfer.engine.runner.cuda_graphs import CAPTURE_ENV, DecodeGraphs, capture_mode


def test_capture_mode_reads_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    assert capture_mode() == "startup"
    monkeypatch.setenv(CAPTURE_ENV, "Lazy")
    assert capture_mode() == "lazy" and capture_mode("startup") == "startup"
    monkeypatch.setenv(CAPTURE_ENV, "sometimes")
    with pytest.raises(ValueError, match=CAPTURE_ENV):
        capture_mode()
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        capture_mode("eventually")


def test_llm_refuses_an_unknown_capture_mode(model_dir):
    with pytest.raises(ValueError, match="cuda_graph_capture='eventually'"):
        LLM(model=model_dir, device="cpu", cuda_graph_capture="eventually")


def test_lazy_buckets_are_made_on_first_use_and_keep_the_eager_bits(model_dir):
    from tests.engine.test_overlap import _requests, _view

    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=40, max_num_seqs=12,
              max_num_batched_tokens=48)
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = _view(llm.generate(prompts, params, use_tqdm=False))
    runner = llm.engine.runner
    # Buckets up to 64 while the engine decodes at most 12 rows: the big ones are never needed.
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 512, 64, torch.device("cpu"))
    graphs.capture_lazily(stand_ins=True)
    assert graphs.stats.buckets == [] and graphs.lazy
    llm.engine.executor.graphs = graphs
    for overlap in (True, False):
        llm.engine.async_scheduling = overlap
        assert _view(llm.generate(prompts, params, use_tqdm=False)) == eager
    made = graphs.stats.buckets
    assert made and max(made) <= 16 and set(made) < set(graphs.buckets), made   # only those needed
    stats = llm.get_stats()
    assert stats["graph_steps"] > 0 and stats["cuda_graph_buckets"] == made, stats
    # A second pass over the same requests makes no new bucket.
    assert _view(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert graphs.stats.buckets == made


def test_pipeline_engine_asks_for_lazy_capture(monkeypatch, model_dir):
    from deepinfer.pipeline.stages import generate

    seen = []

    class Probe:
        def __init__(self, **kw) -> None:
            seen.append(capture_mode(kw.get("cuda_graph_capture")))

    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    monkeypatch.setattr("deepinfer.engine.LLM", Probe, raising=False)
    generate._build_llm(model_dir, {})
    assert seen == ["lazy"] and CAPTURE_ENV not in __import__("os").environ   # an argument, not the env
    monkeypatch.setenv(CAPTURE_ENV, "startup")   # the user's setting wins
    generate._build_llm(model_dir, {})
    assert seen[-1] == "startup"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lazy_capture_gives_the_startup_capture_bits(monkeypatch, tiny_checkpoint):
    from tests.engine.test_cuda_graphs_gpu import _outputs

    path = str(tiny_checkpoint("llama", dtype=torch.bfloat16))
    results = {}
    for mode in ("startup", "lazy"):
        monkeypatch.setenv(CAPTURE_ENV, mode)
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model=path, dtype="bfloat16", device="cuda", seed=0, max_model_len=512, max_num_seqs=64,
                  num_kv_blocks=2048)
        before = llm.get_stats()["cuda_graph_buckets"]
        assert (before == [] if mode == "lazy" else before[-1] == 64), before
        results[mode] = {n: _outputs(llm, n) for n in (1, 7, 64)}
        stats = llm.get_stats()
        assert stats["graph_steps"] > 0 and stats["cuda_graph_capture_s"] > 0, stats
        if mode == "lazy":
            assert 0 < len(stats["cuda_graph_buckets"]) <= 20
            print(f"lazy: buckets {stats['cuda_graph_buckets']} in {stats['cuda_graph_capture_s']:.2f} s")
        del llm
    assert results["lazy"] == results["startup"]


def test_steps_with_rows_past_the_split_threshold_replay_split_graphs(model_dir):
    """A decode step with a row at or past `split_from` replays its bucket's split graph (captured on first
    use, its metadata marked split_kv so paged attention takes its static split launches); the others the
    one-program graphs; the outputs keep the eager bits."""
    from tests.engine.test_overlap import _requests, _view

    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=40, max_num_seqs=12,
              max_num_batched_tokens=48)
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = _view(llm.generate(prompts, params, use_tqdm=False))
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 512, 64, torch.device("cpu"),
                          split_from=60)   # rows reach 40 + 30 prompt + 20 output tokens: both kinds
    graphs.capture_lazily(stand_ins=True)
    llm.engine.executor.graphs = graphs
    for overlap in (True, False):
        llm.engine.async_scheduling = overlap
        assert _view(llm.generate(prompts, params, use_tqdm=False)) == eager
    stats = llm.get_stats()
    assert stats["cuda_graph_buckets"] and stats["cuda_graph_split_buckets"], stats
    b = stats["cuda_graph_split_buckets"][0]
    assert graphs._meta(b, True).split_kv and not graphs._meta(b).split_kv


def test_split_from_is_the_paged_attention_policys_threshold(model_dir):
    pytest.importorskip("triton")
    from deepinfer.engine.runner.cuda_graphs import attention_split_from
    from deepinfer.kernels.paged_attention import SPLIT_FROM

    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=8)
    runner = llm.engine.runner
    assert attention_split_from(runner.model, runner.kv_caches) == SPLIT_FROM
    assert attention_split_from(torch.nn.Linear(2, 2), runner.kv_caches) is None
