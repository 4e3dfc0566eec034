"""LLM.generate matches Hugging Face transformers token for token (greedy, float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams

ARCHS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 32


def _prompts(n: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def hf_greedy(checkpoints):
    """HF `generate` continuations, one prompt at a time (the independent reference)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[object, dict]] = {}

    def run(arch: str, prompt: list[int]) -> list[int]:
        if arch not in cache:
            model = AutoModelForCausalLM.from_pretrained(checkpoints(arch), dtype=torch.float32).eval()
            # ignore_eos on our side: HF must neither stop at nor suppress EOS (min_new_tokens would).
            model.generation_config.eos_token_id = None
            cache[arch] = (model, {})
        model, memo = cache[arch]
        key = tuple(prompt)
        if key not in memo:
            with torch.no_grad():
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return run


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_request_matches_hf_generate(arch, checkpoints, hf_greedy):
    llm = LLM(model=str(checkpoints(arch)), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = _prompts(1, llm.model_config.vocab_size, seed=1)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(arch, prompt)
    assert out.finish_reason == "length"


ENGINE_SETTINGS = {
    # name: LLM kwargs — each forces a different scheduling path through the same requests.
    "default": dict(num_kv_blocks=512),
    "chunked_prefill": dict(num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=8),
    "preemption": dict(num_kv_blocks=24, max_num_seqs=16),
    "no_prefix_cache": dict(num_kv_blocks=512, enable_prefix_caching=False),
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_thirty_mixed_requests_match_hf(arch, setting, checkpoints, hf_greedy):
    llm = LLM(model=str(checkpoints(arch)), device="cpu", dtype="float32", **ENGINE_SETTINGS[setting])
    prompts = _prompts(30, llm.model_config.vocab_size, seed=2, shared_prefix=20)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(arch, p)


def test_prefix_cache_hits_keep_outputs(checkpoints, hf_greedy):
    llm = LLM(model=str(checkpoints("qwen2")), device="cpu", dtype="float32", num_kv_blocks=512)
    prompts = _prompts(6, llm.model_config.vocab_size, seed=3, shared_prefix=40)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # same prompts: full-block prefix hits
    assert all(o.metrics["num_cached_tokens"] >= 32 for o in second)
    for p, a, b in zip(prompts, first, second):
        assert a.token_ids == b.token_ids == hf_greedy("qwen2", p)
