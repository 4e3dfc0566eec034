"""Prefix caching with DeepSeek-V4's bounded cache (engine/core/window_blocks.py): hits restore exactly.

A hit shares the cached aux blocks (compressed entries) before the hit point and the window blocks of the
last keep_tokens positions; the blocks before are released stand-ins. Checked against transformers' own
DeepseekV4ForCausalLM (float32, tiny random checkpoint) and against the same run without prefix caching.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.window_blocks import RELEASED

from tests.support.hf_parity import hf_step_logits, random_prompts
from tests.support.tiny_deepseek_v4 import hf_v4_available, load_hf_v4, make_tiny_deepseek_v4

pytestmark = pytest.mark.skipif(not hf_v4_available(), reason="transformers has no DeepseekV4 classes")
BS = 4     # hits come in steps of BS * 4 tokens (the finest compression rate)
STEPS = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny_v4_prefix") / "ckpt", seed=3))


def _held_window_blocks(llm: LLM) -> list[int]:
    """Records, at every append_slots, how many window blocks the sequence holds afterwards."""
    bm, held = llm.engine.scheduler.block_manager, []
    append = bm.append_slots

    def recording(seq, n):
        ok = append(seq, n)
        held.append(sum(b != RELEASED for b in seq.block_table))
        return ok

    bm.append_slots = recording
    return held


def test_prefix_hits_match_hf_and_the_uncached_run_with_bounded_windows(ckpt):
    hf = load_hf_v4(ckpt)
    llm = LLM(ckpt, device="cpu", dtype="float32", block_size=BS, max_num_seqs=4, num_kv_blocks=256)
    assert llm.kv_cache_spec.bounded and llm.engine.scheduler.block_manager.enable_prefix_caching
    vocab = llm.model_config.vocab_size
    prompts = random_prompts(6, vocab, seed=5, shared_prefix=3 * 4 * BS + 5, lo=1, hi=12)
    llm.generate([prompts[0][: 3 * 4 * BS + 1]], SamplingParams(max_tokens=1), use_tqdm=False)  # warm
    held = _held_window_blocks(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=4)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert all(o.metrics["num_cached_tokens"] == 3 * 4 * BS for o in outs)   # every request hits at 48
    for p, o in zip(prompts, outs):
        logits, tokens = hf_step_logits(hf, p, STEPS)
        assert o.token_ids == tokens
        for step, lps in enumerate(o.logprobs):
            ref = torch.log_softmax(logits[step][-1].double(), dim=-1)
            for tok, lp in lps.items():
                assert abs(lp.logprob - float(ref[tok])) <= 1e-4, (step, tok)
    bm = llm.engine.scheduler.block_manager
    # Decoding: the kept span plus the token being computed (a prefill chunk may hold more while it runs).
    assert max(held) <= -(-len(max(prompts, key=len)) // BS) and held[-1] <= bm.window_blocks_per_seq
    bm.check_invariants()


def test_seeded_sampling_with_prefix_hits_equals_the_run_without_prefix_caching(ckpt):
    prompts = random_prompts(10, 512, seed=6, shared_prefix=2 * 4 * BS + 3, lo=1, hi=20)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    runs = {}
    for cache in (False, True):
        llm = LLM(ckpt, device="cpu", block_size=BS, max_num_seqs=3, enable_prefix_caching=cache,
                  num_kv_blocks=40)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[cache] = [(o.token_ids, o.logprobs) for o in outs]
        hits = sum(o.metrics["num_cached_tokens"] for o in outs)
        assert (hits > 0) == cache
        llm.engine.scheduler.block_manager.check_invariants()
    assert runs[True] == runs[False]
