"""Tensor parallel at TP=2 on CPU (gloo, rank 1 in a worker process) against the single-process engine.

Tolerance: float32 logits within rtol=atol=2e-5 of the unsharded model's (the row-parallel sums add two
partial matmuls, so the last bits differ from one matmul); greedy tokens identical. Deterministic mode:
a request's sampled bytes are identical whatever batch it shares at a fixed TP size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.parallel.setup import check_tensor_parallel_size
from deepinfer.engine.parallel.sharding import ShardPlan

from tests.support.paged_runner import PagedBatchRunner

TOL = dict(rtol=2e-5, atol=2e-5)
PROMPTS = [list(range(5, 30)), list(range(40, 47)), [7, 8, 9], list(range(100, 140, 3))]


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def tp_llm(llama_dir):
    llm = LLM(llama_dir, device="cpu", num_kv_blocks=96, tensor_parallel_size=2)
    yield llm
    llm.model.shutdown()


@pytest.fixture(scope="module")
def ref_llm(llama_dir) -> LLM:
    return LLM(llama_dir, device="cpu", num_kv_blocks=96)


def paged_logits(model, cfg: ModelConfig) -> list[torch.Tensor]:
    """Logits of a mixed prefill step (two prompts), a chunked prefill + decode step and a decode step."""
    r = PagedBatchRunner(model, cfg)
    r.add("a", list(range(5, 30)))
    r.add("b", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9])
    out = [r.step([("a", 25), ("b", 6)])]
    r.append("a", 11)
    out.append(r.step([("a", 1), ("b", 9)]))
    r.append("a", 12)
    r.append("b", 13)
    out.append(r.step([("b", 1), ("a", 1)]))
    return [t for step in out for t in step.values()]


def test_tp2_llama_logits_match_single_process(tp_llm, ref_llm) -> None:
    cfg = ref_llm.model_config
    got, expected = paged_logits(tp_llm.model, cfg), paged_logits(ref_llm.model, cfg)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, e, **TOL)


def test_tp2_llama_greedy_tokens_and_logprobs_match(tp_llm, ref_llm) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    got, expected = (llm.generate(PROMPTS, sp, use_tqdm=False) for llm in (tp_llm, ref_llm))
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids and g.text == e.text
        for pos_g, pos_e in zip(g.logprobs, e.logprobs, strict=True):
            assert pos_g.keys() == pos_e.keys()
            for tok in pos_e:
                assert abs(pos_g[tok].logprob - pos_e[tok].logprob) < 1e-5


def test_tp2_deterministic_across_batch_compositions(tp_llm) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=11, ignore_eos=True)
    target = PROMPTS[0]
    alone = tp_llm.generate([target], sp, use_tqdm=False)[0]
    crowd = tp_llm.generate([PROMPTS[1], PROMPTS[3], target, PROMPTS[2]], sp, use_tqdm=False)[2]
    behind = tp_llm.generate([target, *PROMPTS[1:], *PROMPTS[1:]], sp, use_tqdm=False)[0]
    for other in (crowd, behind):
        assert other.token_ids == alone.token_ids and other.text == alone.text


def test_tp2_deepseek_v3_matches_single_process(tmp_path_factory) -> None:
    from tests.support.tiny_deepseek import make_tiny_deepseek

    path = str(make_tiny_deepseek("v3", tmp_path_factory.mktemp("ds_tp") / "v3"))
    ref = LLM(path, device="cpu", num_kv_blocks=96)
    tp = LLM(path, device="cpu", num_kv_blocks=96, tensor_parallel_size=2)
    try:
        cfg = ref.model_config
        for g, e in zip(paged_logits(tp.model, cfg), paged_logits(ref.model, cfg), strict=True):
            torch.testing.assert_close(g, e, **TOL)
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got, expected = (llm.generate(PROMPTS, sp, use_tqdm=False) for llm in (tp, ref))
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    finally:
        tp.model.shutdown()


def test_shard_plan_splits_heads_mlp_and_vocabulary(llama_dir) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    plans = [ShardPlan(cfg, r, 2) for r in range(2)]
    local = plans[0].local_config()
    assert (local.num_attention_heads, local.num_key_value_heads) == (cfg.num_attention_heads // 2,
                                                                      cfg.num_key_value_heads // 2)
    assert local.intermediate_size == cfg.intermediate_size // 2 and local.head_dim == cfg.head_dim
    q = torch.arange(cfg.q_size * 4, dtype=torch.float32).reshape(cfg.q_size, 4)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([p.shard(name, q) for p in plans]), q)
    o = q.t()
    o_name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([p.shard(o_name, o) for p in plans], dim=1), o)
    bias = torch.ones(7)
    assert [p.shard("model.layers.0.mlp.down_proj.bias", bias).sum().item() for p in plans] == [7.0, 0.0]
    odd = dataclasses.replace(cfg, vocab_size=cfg.vocab_size - 1)   # last rank's slice is padded
    emb = torch.randn(odd.vocab_size, 4)
    parts = [ShardPlan(odd, r, 2).shard("model.embed_tokens.weight", emb) for r in range(2)]
    assert all(p.shape[0] == -(-odd.vocab_size // 2) for p in parts)
    assert torch.equal(torch.cat(parts)[: odd.vocab_size], emb) and not parts[1][-1].any()
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        ShardPlan(cfg, 0, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            check_tensor_parallel_size(bad)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=4"):   # before any process
        LLM(llama_dir, device="cpu", num_kv_blocks=8, tensor_parallel_size=4)


def test_spec_model_tensor_parallel_size_reaches_the_engine(tmp_path) -> None:
    import yaml
    from deepinfer.pipeline.spec.load import load_spec
    from deepinfer.pipeline.spec.schema import SpecError

    doc = {"model": {"name": "demo", "tensor_parallel_size": 2},
           "input": {"path": "in.jsonl", "format": "jsonl"}, "prompt": {"template": "{{ text }}"},
           "output": {"path": "out"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert load_spec(path).engine_kwargs()["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in load_spec(path, ["model.tensor_parallel_size=1"]).engine_kwargs()
    with pytest.raises(SpecError, match="tensor_parallel_size"):
        load_spec(path, ["model.tensor_parallel_size=0"])


def _batch_invariant(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.9, max_tokens=16, seed=4, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], sp, use_tqdm=False)[0].token_ids
    crowd = llm.generate([*PROMPTS, *PROMPTS], sp, use_tqdm=False)
    assert crowd[3].token_ids == alone and crowd[7].token_ids == alone


@pytest.mark.gpu
def test_tp2_on_two_gpus_matches_one_gpu_and_is_batch_invariant(tiny_checkpoint) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = str(tiny_checkpoint("llama"))
    ref = LLM(path, device="cuda", dtype="float32", num_kv_blocks=96)
    tp = LLM(path, device="cuda", dtype="float32", num_kv_blocks=96, tensor_parallel_size=2)
    try:
        for g, e in zip(paged_logits(tp.model, ref.model_config), paged_logits(ref.model, ref.model_config),
                        strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got, expected = (llm.generate(PROMPTS, sp, use_tqdm=False) for llm in (tp, ref))
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        _batch_invariant(tp)
    finally:
        tp.model.shutdown()
    bf16 = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=96, tensor_parallel_size=2)
    try:
        _batch_invariant(bf16)
    finally:
        bf16.model.shutdown()
