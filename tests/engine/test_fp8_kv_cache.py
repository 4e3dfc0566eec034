"""FP8 KV cache (kv_cache_dtype="fp8") on CPU: greedy agreement within a logit tolerance, twice the blocks
per byte of a bf16 cache, batch invariance in deterministic mode, reference store/attention consistency.

Tolerance (documented): with the static per-head scale 1.0, teacher-forced log-probabilities of the tiny
float32 Llama move by at most LOGPROB_TOL; every greedy token the FP8 cache picks is within LOGPROB_TOL of
the full-precision model's best token at that position (measured worst: ~0.16).
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.kernels.reference.attention import chunked_paged_attention, paged_attention_ref
from deepinfer.kernels.reference.kv_fp8 import quantize_kv_ref, store_kv_fp8_ref

from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

LOGPROB_TOL = 0.3
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def llms(model_dir):
    full = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=128)
    fp8 = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=128, kv_cache_dtype="fp8")
    return full, fp8


def test_fp8_kv_greedy_within_logprob_tolerance(llms):
    full, fp8 = llms
    prompts = _prompts(3, full.model_config.vocab_size, seed=11)
    for prompt, out in zip(prompts, fp8.generate(prompts, GREEDY, use_tqdm=False)):
        seq = prompt + out.token_ids
        probe = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        ref = full.generate([seq], probe, use_tqdm=False)[0].prompt_logprobs
        got = fp8.generate([seq], probe, use_tqdm=False)[0].prompt_logprobs
        for i in range(len(prompt), len(seq)):
            best = max(lp.logprob for lp in ref[i].values())
            assert ref[i][seq[i]].logprob >= best - LOGPROB_TOL, i
            assert abs(ref[i][seq[i]].logprob - got[i][seq[i]].logprob) <= LOGPROB_TOL, i


def test_fp8_kv_doubles_blocks_of_a_bf16_cache(model_dir):
    bf16 = LLM(model=model_dir, device="cpu", dtype="bfloat16", cpu_kv_cache_gib=0.01)
    fp8 = LLM(model=model_dir, device="cpu", dtype="bfloat16", cpu_kv_cache_gib=0.01, kv_cache_dtype="fp8")
    assert fp8.kv_cache_spec.bytes_per_block * 2 == bf16.kv_cache_spec.bytes_per_block
    assert fp8.cache_cfg.num_blocks == 2 * bf16.cache_cfg.num_blocks


def test_fp8_kv_and_weights_stay_batch_invariant(model_dir):
    vocab = 200
    prompts = _prompts(12, vocab, seed=5)
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(12)]
    kw = dict(device="cpu", dtype="float32", kv_cache_dtype="fp8", quantization="fp8")
    together = LLM(model=model_dir, num_kv_blocks=256, **kw).generate(prompts, params, use_tqdm=False)
    tight = LLM(model=model_dir, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=13,
                enable_prefix_caching=False, **kw)
    order = list(range(12))
    random.Random(1).shuffle(order)
    outs = tight.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert {i: o.token_ids for i, o in zip(order, outs)} == {i: o.token_ids for i, o in enumerate(together)}


def test_fp8_kv_rejected_for_mla(tmp_path):
    from tests.support.tiny_deepseek import make_tiny_deepseek

    path = make_tiny_deepseek("v3_qnull", tmp_path / "ds")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported"):
        LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")


def test_reference_store_and_attention_agree_on_fp8_cache():
    gen = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 16, 4, 2, 16
    lens = [(37, 5), (9, 9)]
    tables, num_blocks = random_block_lists([c for c, _ in lens], block_size, seed=1)
    meta = build_metadata([SeqStep(b, c, q) for b, (c, q) in zip(tables, lens)], block_size)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.25])
    slots = torch.cat([torch.tensor(list(b)).repeat_interleave(block_size)[:c] * block_size
                       + torch.arange(c) % block_size for b, (c, _) in zip(tables, lens)])
    k = torch.randn(slots.shape[0], kv_heads, dim, generator=gen)
    v = torch.randn(slots.shape[0], kv_heads, dim, generator=gen)
    store_kv_fp8_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots].view(torch.uint8),
                       quantize_kv_ref(k, k_scale).view(torch.uint8))
    q = torch.randn(meta.num_tokens, heads, dim, generator=gen)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, k_scale, v_scale)
    chunked = chunked_paged_attention(q, k_cache, v_cache, meta, 0.25, k_scale, v_scale)
    torch.testing.assert_close(chunked, ref, rtol=1e-5, atol=1e-5)
    # The same as attention over the dequantized cache in float32.
    deq = (k_cache.float() * k_scale.view(1, 1, -1, 1), v_cache.float() * v_scale.view(1, 1, -1, 1))
    torch.testing.assert_close(paged_attention_ref(q, *deq, meta, 0.25), ref, rtol=1e-5, atol=1e-5)
