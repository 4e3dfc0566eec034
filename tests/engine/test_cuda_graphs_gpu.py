"""GPU: CUDA graphs and the overlapped loop change no bit of any output (deterministic mode).

Graphs on vs off, and the overlapped vs the synchronous loop, give identical tokens and logprobs at batch
sizes 1, 7 and 64 (padded into buckets 1, 8 and 64), on a tiny random model and on the Qwen2.5-0.5B shape
with random weights; graphs really ran (get_stats), and capture time and memory are reported. Programmatic
dependent launch (kernels/pdl.py) on vs off gives the same bits too, in graphs and eagerly.
"""

from __future__ import annotations

import gc
import json
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

QWEN_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": None,
}


@pytest.fixture(scope="module", params=["tiny-llama", "qwen2.5-0.5b"])
def model(request, tiny_checkpoint, tmp_path_factory):
    """(model dir, load_format)."""
    if request.param == "tiny-llama":
        return str(tiny_checkpoint("llama", dtype=torch.bfloat16)), "auto"
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = tmp_path_factory.mktemp("qwen05b")
    (d / "config.json").write_text(json.dumps(QWEN_05B))
    write_tokenizer_files(d)
    return str(d), "dummy"


def _llm(model, **kw):
    from deepinfer.engine import LLM

    gc.collect()
    torch.cuda.empty_cache()  # the previous engine's cache must be gone before sizing this one
    path, load_format = model
    kw.setdefault("num_kv_blocks", 2048)
    return LLM(model=path, dtype="bfloat16", device="cuda", load_format=load_format, seed=0,
               max_model_len=512, max_num_seqs=64, **kw)


def _requests(n: int, vocab: int):
    from deepinfer.engine import SamplingParams

    rng = random.Random(n)
    prefix = [rng.randrange(10, vocab) for _ in range(40)]
    prompts = [(prefix if i % 4 == 0 else []) + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 90))]
               for i in range(n)]
    params = []
    for i in range(n):
        if i % 5 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, logprobs=2))
        elif i % 5 == 1:   # stops early on one of many stop ids: finished rows dropped one step late
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=24, min_tokens=2,
                                         stop_token_ids=list(range(10, vocab, 4)), logprobs=1))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, ignore_eos=True,
                                         max_tokens=rng.randint(1, 24), logprobs=1))
    return prompts, params


def _outputs(llm, n: int):
    prompts, params = _requests(n, llm.model_config.vocab_size)
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_graphs_and_overlap_change_no_bit(model):
    sizes = (1, 7, 64)
    ref_llm = _llm(model, enable_cuda_graphs=False, async_scheduling=False)
    assert ref_llm.get_stats()["cuda_graphs_enabled"] is False
    reference = {n: _outputs(ref_llm, n) for n in sizes}
    del ref_llm
    llm = _llm(model)   # graphs and overlap on (the defaults)
    stats = llm.get_stats()
    assert stats["cuda_graphs_enabled"] and stats["cuda_graph_buckets"][-1] == 64
    assert stats["cuda_graph_capture_s"] > 0
    mib = stats["cuda_graph_memory_bytes"] / 2**20
    print(f"capture: {stats['cuda_graph_capture_s']:.2f} s, {mib:.1f} MiB")
    for n in sizes:
        assert _outputs(llm, n) == reference[n], f"graphs + overlap differ at batch {n}"
    stats = llm.get_stats()
    assert stats["graph_steps"] > 0 and stats["overlapped_steps"] > 0, stats
    llm.engine.async_scheduling = False   # graphs with the synchronous loop
    for n in sizes:
        assert _outputs(llm, n) == reference[n], f"graphs (sync loop) differ at batch {n}"


def test_graphs_under_preemption_and_chunked_prefill(model):
    few_blocks = dict(num_kv_blocks=24, max_num_batched_tokens=64)
    ref = _outputs(_llm(model, enable_cuda_graphs=False, async_scheduling=False, **few_blocks), 64)
    llm = _llm(model, **few_blocks)
    assert _outputs(llm, 64) == ref
    assert llm.get_stats()["graph_steps"] > 0


def test_env_var_turns_graphs_off(model, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISABLE_CUDA_GRAPHS", "1")
    assert _llm(model).get_stats()["cuda_graphs_enabled"] is False


def test_programmatic_dependent_launch_changes_no_bit(model, monkeypatch):
    """kernels/pdl.py: the decode path's kernels launched early (each waits for its producers before any
    memory access) give the bits of plain launches, in graphs and eagerly."""
    from deepinfer.kernels.pdl import pdl_options

    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_options(torch.device("cuda")), "PDL should be on by default on sm_90+"
    _switch_changes_no_bit(model, monkeypatch, "DEEPINFER_DISABLE_PDL", "PDL")


def _switch_changes_no_bit(model, monkeypatch, env: str, what: str) -> None:
    """Outputs at batch sizes 1, 7, 64 with the feature `env` turns off (env=1) are the reference; with it on
    (the default), in graphs and eagerly, they must be the same."""
    sizes = (1, 7, 64)
    monkeypatch.setenv(env, "1")
    plain = _llm(model)
    reference = {n: _outputs(plain, n) for n in sizes}
    del plain
    monkeypatch.delenv(env)
    for graphs in (True, False):
        llm = _llm(model, enable_cuda_graphs=graphs)
        for n in sizes:
            assert _outputs(llm, n) == reference[n], f"{what} (graphs={graphs}) differs at batch {n}"
        del llm


def test_split_k_partials_summed_in_the_norm_change_no_bit(model, monkeypatch):
    """Ops.linear_into_norm: the 0.5B down projection's decode-bucket split-K hands its partials to the next
    RMSNorm, which sums them itself (kernels/rmsnorm.py); the bits are those of the reduce kernel's path
    ($DEEPINFER_DISABLE_SPLIT_SUM_IN_NORM=1), in graphs and eagerly."""
    from deepinfer.kernels import matmul

    deferred = []
    real = matmul.split_partials
    monkeypatch.setattr(matmul, "split_partials", lambda *a, **kw: deferred.append(1) or real(*a, **kw))
    _switch_changes_no_bit(model, monkeypatch, "DEEPINFER_DISABLE_SPLIT_SUM_IN_NORM", "sum in the norm")
    if model[1] == "dummy":   # the 0.5B shape: its down projection splits K at decode sizes
        assert deferred, "no projection handed its partials to a norm"


def test_flattened_gemm_tile_loops_change_no_bit(model, monkeypatch):
    """MatmulConfig.flatten (the prefill buckets' persistent tile loops pipelined with their K loops) gives
    the bits of the unflattened loops ($DEEPINFER_DISABLE_GEMM_FLATTEN=1) on a whole model."""
    _switch_changes_no_bit(model, monkeypatch, "DEEPINFER_DISABLE_GEMM_FLATTEN", "flattened GEMMs")


def test_split_kv_rows_keep_their_bits_in_graphs_and_batches(model, monkeypatch):
    """Paged attention's split-KV form (kernels/paged_attention.py) with its threshold lowered so these short
    requests cross it (rows from 128 positions on split: the plain family's 128-key tiles): outputs at
    batch sizes 1, 7, 64 are those of eager synchronous steps, with graphs (the decode buckets' split
    graphs, the prefill buckets' split graphs: this tile merges a row's ranges in place) and overlap on."""
    monkeypatch.setattr("deepinfer.kernels.paged_attention.SPLIT_FROM", 64)
    sizes = (1, 7, 64)
    ref_llm = _llm(model, enable_cuda_graphs=False, async_scheduling=False)
    reference = {n: _outputs(ref_llm, n) for n in sizes}
    long_reference = _long_prompt_outputs(ref_llm)
    del ref_llm
    llm = _llm(model)
    graphs = llm.engine.executor.graphs
    assert graphs.split_from == 128, graphs.split_from
    for n in sizes:
        assert _outputs(llm, n) == reference[n], f"split-KV rows differ in graphs at batch {n}"
    assert _long_prompt_outputs(llm) == long_reference, "prompts past the split threshold differ in graphs"
    stats = llm.get_stats()
    assert stats["cuda_graph_split_buckets"] and stats["graph_steps"] > 0, stats
    assert stats["prefill_graph_split_buckets"] and stats["prefill_graph_steps"] > 0, stats


def _long_prompt_outputs(llm):
    """Prompts of 129-400 tokens (prefill rows past a 128-position split threshold), more of them than the
    engine's 64 slots so some are admitted next to decoding rows (mixed steps)."""
    from deepinfer.engine import SamplingParams

    rng = random.Random(7)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(129, 400))] for _ in range(72)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6, ignore_eos=True,
                             logprobs=1) for i in range(72)]
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
