"""MTP speculative decoding for DeepSeek-V4 (engine/spec_decode/v4_mtp_model.py): bytes with drafts = without.

Checkpoints: tiny random V4 ones from tests/support/tiny_deepseek_v4.py (transformers' own classes) given a
complete MTP module `mtp.0.*` in DeepSeek's naming (`write_v4_mtp_module`): random (mostly rejected drafts:
verification and rollback of the window and compressed caches are exercised) or built to always agree.
The bounded window + compressed cache runs with prefix caching off and on (hits then share its blocks).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.window_blocks import RELEASED
from deepinfer.engine.layers.v4_cache import entry_layout
from deepinfer.engine.spec_decode.config import MTPConfig
from deepinfer.engine.spec_decode.v4_mtp_model import V4MTPDraftModel

from tests.support.tiny_deepseek_v4 import WINDOW, hf_v4_available, make_tiny_deepseek_v4, write_v4_mtp_module

pytestmark = pytest.mark.skipif(not hf_v4_available(), reason="transformers has no DeepseekV4 classes")

# Always draft the maximum (a random draft is rarely confident): the most verification work per step.
EAGER = MTPConfig(max_draft_len=3, confidence_threshold=0.0, auto_disable=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_v4_mtp")
    fake = make_tiny_deepseek_v4(root / "fake")              # as built: an incomplete (fake) MTP module
    random_mtp = write_v4_mtp_module(shutil.copytree(fake, root / "random"), seed=1)
    agree = write_v4_mtp_module(make_tiny_deepseek_v4(root / "agree", seed=2), agree=True)
    return {"random": str(random_mtp), "agree": str(agree), "fake": str(fake)}


def _requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts up to several windows long (some sharing a prefix), mixed sampling at T=0.8, seeded."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 400) for _ in range(2 * WINDOW + 3)]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(10, 400) for _ in range(rng.randint(2, 3 * WINDOW))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
        extra: dict = {}
        if i % 4 == 1:
            extra.update(top_k=20, top_p=0.9)
        if i % 5 == 2:
            extra.update(repetition_penalty=1.3, presence_penalty=0.5)
        params.append(SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=rng.randint(4, 3 * WINDOW),
                                     logprobs=2 if i % 2 else None, ignore_eos=i % 7 != 0, **extra))
    return prompts, params


def _signature(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.finish_reason, o.text) for o in outs]


def _run(path: str, prompts, params, **kw) -> tuple[list[tuple], dict, LLM]:
    llm = LLM(path, **{"device": "cpu", **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return _signature(outs), llm.get_stats(), llm


@pytest.fixture(scope="module")
def sampled_case(ckpts):
    prompts, params = _requests(24)
    base, stats, _ = _run(ckpts["random"], prompts, params, max_num_seqs=24)
    assert stats["spec_drafted_tokens"] == 0
    return prompts, params, base


@pytest.mark.parametrize(("max_num_seqs", "prefix_caching"),
                         [(1, False), (5, True), (24, False), (24, True)],
                         ids=["1", "5-prefix_cache", "24", "24-prefix_cache"])
def test_sampling_with_mtp_is_byte_identical(ckpts, sampled_case, max_num_seqs, prefix_caching):
    prompts, params, base = sampled_case
    n = 6 if max_num_seqs == 1 else len(prompts)   # a request's bytes do not depend on the others
    # Blocks of 4 tokens: with prefix caching the shared 19-token prefix hits at 16 (block_size * 4).
    got, stats, llm = _run(ckpts["random"], prompts[:n], params[:n], max_num_seqs=max_num_seqs,
                           enable_prefix_caching=prefix_caching, speculative_mtp=EAGER, block_size=4)
    assert got == base[:n]
    if prefix_caching:
        assert llm.engine.scheduler.block_manager.num_cached_free_blocks > 0
    assert isinstance(llm.engine.spec.proposer.draft, V4MTPDraftModel)
    assert llm.kv_cache_spec.bounded   # with prefix caching too (core/window_blocks.py)
    drafted, accepted = stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]
    assert drafted > 30 and 0 < accepted < drafted       # both accepts and rejections were exercised
    per_step = 1 + accepted / stats["spec_verify_steps"]
    assert stats["spec_mean_tokens_per_verify_step"] == pytest.approx(per_step)


def test_a_draft_that_always_agrees_commits_four_tokens_per_verify_step(ckpts):
    prompts = [[11 + i for i in range(3 * WINDOW)], [30, 31, 32], [40 + i for i in range(WINDOW + 1)],
               [50] * 20]
    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    for prefix_caching in (False, True):
        plain, _, _ = _run(ckpts["agree"], prompts, greedy, enable_prefix_caching=prefix_caching)
        got, stats, _ = _run(ckpts["agree"], prompts, greedy, enable_prefix_caching=prefix_caching,
                             speculative_mtp=EAGER)
        assert got == plain
        # 17 tokens: one from the prefill step, then 4 verify steps of 3 accepted drafts + the target's token.
        assert stats["spec_drafted_tokens"] == stats["spec_accepted_tokens"] == 4 * 4 * 3
        assert stats["spec_mean_tokens_per_verify_step"] == 4.0 and stats["spec_steps"] == 5


def test_stop_strings_and_tokens_inside_an_accepted_run(ckpts):
    prompts = [[11 + 3 * i for i in range(n)] for n in (5, 9, 14, 20, 26, 31)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base, _, _ = _run(ckpts["agree"], prompts, greedy)
    stopped = []
    for i, (tokens, _, _, text) in enumerate(base):
        cut = 5 + i   # inside the second or third verify step's accepted run
        stopped.append(dataclasses.replace(greedy, stop_token_ids=[tokens[cut]]) if i % 2 else
                       dataclasses.replace(greedy, stop=[text[len(text) // 2: len(text) // 2 + 2]]))
    plain, _, _ = _run(ckpts["agree"], prompts, stopped)
    got, stats, _ = _run(ckpts["agree"], prompts, stopped, speculative_mtp=EAGER)
    assert got == plain and all(f == "stop" for _, _, f, _ in plain)
    assert stats["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_preemption_and_chunked_prefill(ckpts, prefix_caching):
    prompts, params = _requests(10, seed=3)
    params = [dataclasses.replace(p, max_tokens=WINDOW + 6, n=1 + i % 2) for i, p in enumerate(params)]
    # Blocks of 16 tokens, too few for 8 sequences (bounded: 2 window blocks each while decoding).
    kw = dict(max_num_seqs=8, num_kv_blocks=6, max_num_batched_tokens=24,
              enable_prefix_caching=prefix_caching)
    llm_plain = LLM(ckpts["random"], device="cpu", **kw)
    plain = [_signature(o.outputs) for o in llm_plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(ckpts["random"], device="cpu", speculative_mtp=EAGER, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [_signature(o.outputs) for o in outs] == plain
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert llm.get_stats()["spec_drafted_tokens"] > 0
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def _valid_entries(llm: LLM, seq) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, entry) -> the bounded pool's compressed row, for every entry whose window is computed."""
    cfg, caches = llm.model.config, llm.engine.runner.kv_caches
    bs, finest = llm.cache_cfg.block_size, llm.kv_cache_spec.entry_rate
    rows = {}
    for layer in range(cfg.num_hidden_layers):
        lay = entry_layout(cfg, layer)
        if not lay.series:
            continue
        aux = caches[layer][1].view(-1, lay.compressed_width)
        rate = cfg.rate(cfg.layer_types[layer])
        for w in range(seq.num_computed_tokens // rate):
            e = (w + 1) * rate // finest - 1   # the index of the entry's closing token (layers/v4_cache.py)
            rows[layer, w] = aux[seq.aux_block_table[e // bs] * bs + e % bs].clone()
            assert rows[layer, w].abs().sum() > 0
    return rows


def _step_one(llm: LLM, prompt: list[int], params: SamplingParams) -> list[dict]:
    (seq,) = llm._make_seqs(0, prompt, params)
    llm.engine.add(seq)
    snapshots = []
    while not llm.engine.step():
        assert sum(b != RELEASED for b in seq.block_table) <= llm.engine.scheduler.block_manager \
            .window_blocks_per_seq + 3   # a verify step of 1 + 3 tokens may hold one block more
        snapshots.append((seq.num_computed_tokens, _valid_entries(llm, seq)))
    llm.engine.abort_all()
    return snapshots


def test_compressed_entries_from_rejected_drafts_do_not_survive(ckpts):
    """Bounded layout: after every step, each compressed entry of a computed window equals the plain run's at
    the same length, although rejected drafts closed windows in between (their entries were rebuilt)."""
    prompt = [17 + 5 * i for i in range(2 * WINDOW + 1)]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4 * WINDOW, ignore_eos=True)
    plain = dict(_step_one(LLM(ckpts["random"], device="cpu", enable_prefix_caching=False), prompt, params))
    llm = LLM(ckpts["random"], device="cpu", enable_prefix_caching=False, speculative_mtp=EAGER)
    spec = _step_one(llm, prompt, params)
    stats = llm.get_stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    compared = 0
    for n, entries in spec:
        assert entries.keys() == plain[n].keys()
        for key, row in entries.items():
            assert torch.equal(row, plain[n][key]), (n, key)
            compared += 1
    assert compared > 30 and len(spec) < len(plain) - 3    # fewer steps: drafts were accepted too


def test_incomplete_mtp_module_leaves_mtp_off_with_a_warning(ckpts, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
        llm = LLM(ckpts["fake"], device="cpu", speculative_mtp=EAGER)
    assert llm.engine.spec is None and not llm.model.keep_streams
    assert any("does not load" in r.getMessage() and "stays off" in r.getMessage() for r in caplog.records)
    out = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_v4_mtp_is_byte_identical_on_cuda_in_bfloat16(ckpts, sampled_case, prefix_caching):
    """Deterministic mode on the GPU: a verify row's logits equal a decode row's, so the bytes match too."""
    prompts, params, _ = sampled_case
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, num_kv_blocks=256,
              enable_prefix_caching=prefix_caching)
    plain, _, _ = _run(ckpts["random"], prompts, params, **kw)
    got, stats, _ = _run(ckpts["random"], prompts, params, speculative_mtp=EAGER, **kw)
    assert got == plain and stats["spec_drafted_tokens"] > 0
