"""MTP speculative decoding (engine/spec_decode/): output with drafts = output without them, byte for byte.

Checkpoints: tiny random DeepSeek-V3 ones from tests/support/tiny_deepseek.py with a complete MTP layer
(`write_mtp_layer`): random (the draft mostly disagrees, so verification and rollback are exercised) or built
to always agree with the target (the expected tokens per step can be checked exactly).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.block_manager import hash_block
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.registry import build_model
from deepinfer.engine.spec_decode.config import MTP_ENV, MTPConfig, resolve_mtp_option
from deepinfer.engine.spec_decode.policy import DraftPolicy, SpecStats
from deepinfer.engine.spec_decode.setup import MTPLoader
from deepinfer.engine.spec_decode.verify import num_accepted

from tests.support.scheduler_harness import make_scheduler, make_seq
from tests.support.tiny_deepseek import make_tiny_deepseek, write_mtp_layer

# Always draft the maximum (a random draft is rarely confident): the most verification work per step.
EAGER = MTPConfig(max_draft_len=3, confidence_threshold=0.0, auto_disable=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_mtp")
    fake = make_tiny_deepseek("v3", root / "fake")          # as built: an incomplete (fake) MTP layer
    random_mtp = write_mtp_layer(shutil.copytree(fake, root / "random"), seed=1)
    agree = write_mtp_layer(make_tiny_deepseek("v3_qnull", root / "agree"), agree=True)
    return {"random": str(random_mtp), "agree": str(agree), "fake": str(fake)}


def _requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts (some sharing a prefix) and mixed sampling parameters at temperature 0.8, each seeded."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 400) for _ in range(20)]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(10, 400) for _ in range(rng.randint(2, 24))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
        extra: dict = {}
        if i % 4 == 1:
            extra.update(top_k=20, top_p=0.9)
        if i % 5 == 2:
            extra.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
        if i % 6 == 3:
            extra.update(min_tokens=4, stop_token_ids=[rng.randrange(10, 400) for _ in range(40)])
        params.append(SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=rng.randint(4, 14),
                                     logprobs=2 if i % 2 else None, ignore_eos=i % 7 != 0, **extra))
    return prompts, params


def _signature(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.finish_reason, o.text, getattr(o, "prompt_logprobs", None))
            for o in outs]


def _run(path: str, prompts, params, **kw) -> tuple[list[tuple], dict]:
    llm = LLM(path, **{"device": "cpu", **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return _signature(outs), llm.get_stats()


@pytest.fixture(scope="module")
def sampled_case(ckpts):
    prompts, params = _requests(48)
    base, stats = _run(ckpts["random"], prompts, params, max_num_seqs=48)
    assert stats["spec_drafted_tokens"] == 0 and stats["spec_accepted_tokens"] == 0
    return prompts, params, base


@pytest.mark.parametrize("max_num_seqs", [1, 7, 48])
def test_sampling_with_mtp_is_byte_identical_across_batch_sizes(ckpts, sampled_case, max_num_seqs):
    prompts, params, base = sampled_case
    # One at a time, a quarter of the requests keeps the test fast: a request's bytes do not depend on
    # which others run, so any subset is compared against the same rows.
    n = 12 if max_num_seqs == 1 else len(prompts)
    got, stats = _run(ckpts["random"], prompts[:n], params[:n], max_num_seqs=max_num_seqs,
                      speculative_mtp=EAGER)
    assert got == base[:n]
    assert stats["spec_enabled"] and stats["spec_active"]
    drafted, accepted = stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]
    assert drafted > 30 and 0 < accepted < drafted       # both accepts and rejections were exercised
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert stats["spec_mean_tokens_per_verify_step"] == pytest.approx(
        1 + accepted / stats["spec_verify_steps"])


def test_stop_strings_and_stop_tokens_end_an_accepted_run_where_plain_decoding_does(ckpts, sampled_case):
    prompts, params, base = (x[:24] for x in sampled_case)
    stopped = []
    for p, (tokens, _, _, text, _) in zip(params, base):
        stop = [text[len(text) // 2: len(text) // 2 + 2]] if len(text.strip()) >= 4 else None
        stop_ids = [tokens[len(tokens) // 2]] if len(tokens) >= 4 and not stop else None
        stopped.append(dataclasses.replace(p, stop=stop, stop_token_ids=stop_ids, min_tokens=0))
    # Constrained requests (they never draft) and prompt logprobs in the same batches.
    extra = [SamplingParams(temperature=0.8, seed=7, max_tokens=16, choice=["red apple", "green pear"]),
             SamplingParams(temperature=0.8, seed=8, max_tokens=12, regex=r"[a-z]{2,6} [0-9]{2}"),
             SamplingParams(temperature=0.8, seed=9, max_tokens=12, prompt_logprobs=2, logprobs=1)]
    prompts = prompts + prompts[:3]
    stopped += extra
    plain, _ = _run(ckpts["random"], prompts, stopped, max_num_seqs=16)
    got, stats = _run(ckpts["random"], prompts, stopped, max_num_seqs=16, speculative_mtp=EAGER)
    assert got == plain
    assert sum(f == "stop" for _, _, f, _, _ in plain) >= 12 and stats["spec_accepted_tokens"] > 0
    assert plain[-3][3] in ("red apple", "green pear") and plain[-1][4] is not None


def test_greedy_with_preemption_prefix_hits_and_siblings(ckpts):
    prompts, _ = _requests(12, seed=3)
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, n=1 + i % 2)
              for i in range(len(prompts))]
    # 10 blocks of 16 tokens for requests of up to 3 blocks each: preemption; shared prefixes: cache hits.
    kw = dict(max_num_seqs=8, num_kv_blocks=10, max_num_batched_tokens=24)   # + chunked prefill
    llm_plain = LLM(ckpts["random"], device="cpu", **kw)
    plain = [_signature(o.outputs) for o in llm_plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(ckpts["random"], device="cpu", speculative_mtp=EAGER, **kw)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [_signature(o.outputs) for o in outs] == plain
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0
    assert llm.get_stats()["spec_drafted_tokens"] > 0
    llm.engine.scheduler.block_manager.check_invariants()
    assert llm.engine.scheduler.block_manager.num_free_blocks == 10


def test_a_draft_that_always_agrees_commits_one_plus_draft_length_tokens_per_step(ckpts):
    prompts, _ = _requests(4, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    plain, _ = _run(ckpts["agree"], prompts, greedy)
    got, stats = _run(ckpts["agree"], prompts, greedy, speculative_mtp=EAGER)
    assert got == plain
    # 17 tokens: one from the prefill step, then 4 verify steps of 3 accepted drafts + the target's token.
    assert stats["spec_drafted_tokens"] == stats["spec_accepted_tokens"] == 4 * 4 * 3
    assert stats["spec_verify_steps"] == 4 * 4
    assert stats["spec_mean_tokens_per_verify_step"] == 4.0
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_steps"] == 5             # all four requests in one batch: prefill + 4 verify steps
    # With the default confidence threshold the agreeing draft is still always accepted.
    got, stats = _run(ckpts["agree"], prompts, greedy, speculative_mtp=True)
    assert got == plain and stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0


def test_env_variable_turns_mtp_on_and_auto_off_keeps_outputs(ckpts, sampled_case, monkeypatch):
    prompts, params, plain = (x[12:24] for x in sampled_case)
    monkeypatch.setenv(MTP_ENV, "1")
    assert resolve_mtp_option(None) == MTPConfig() and resolve_mtp_option(False) is None
    # A random draft does not pay: after min_rows measured rows drafting turns itself off mid-run.
    got, stats = _run(ckpts["random"], prompts, params, speculative_mtp=MTPConfig(
        confidence_threshold=0.0, min_rows=8))
    assert got == plain
    assert stats["spec_enabled"] and not stats["spec_active"]
    assert "estimated speed-up" in stats["spec_disabled_reason"]
    assert 0 < stats["spec_estimated_speedup"] < 1
    assert stats["overlap_steps"] > 0              # the rest of the run took the overlapped loop


def test_models_without_mtp_layers_ignore_the_flag_with_a_warning(ckpts, model_dir, monkeypatch, caplog):
    monkeypatch.setenv(MTP_ENV, "1")
    for path, why in [(model_dir, "no multi-token-prediction layers"), (ckpts["fake"], "does not load")]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
            llm = LLM(path, device="cpu")
        assert any(why in r.getMessage() and "stays off" in r.getMessage() for r in caplog.records), why
        out = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        assert llm.get_stats()["spec_drafted_tokens"] == 0 and llm.engine.spec is None
    # A DeepSeek config that counts no MTP layers (DeepSeek-V2 has none).
    raw = json.loads((Path(ckpts["fake"]) / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    cfg = ModelConfig.from_dict(raw)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
        assert MTPLoader.for_model(None, cfg, build_model(cfg, make_ops("cpu", True), torch.float32, "cpu")) \
            is None
    assert any("counts no MTP layers" in r.getMessage() for r in caplog.records)


def test_block_fp8_checkpoint_mtp_layer_is_dequantized_and_drafts(ckpts, tmp_path):
    from tests.support.fp8_checkpoints import write_fp8_copy

    fp8 = str(write_fp8_copy(ckpts["random"], tmp_path / "fp8", "block", (16, 16)))
    prompts, params = _requests(4, seed=11)
    kw = dict(dtype="float32", quantization=None)
    plain, _ = _run(fp8, prompts, params, **kw)
    got, stats = _run(fp8, prompts, params, speculative_mtp=EAGER, **kw)
    assert got == plain and stats["spec_enabled"] and stats["spec_drafted_tokens"] > 0


def _verify_step(sched, seq, drafts: list[int], committed: list[int]):
    """Schedule `seq` with `drafts` and apply a runner output that commits `committed`."""
    seq.draft_token_ids = list(drafts)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.draft_token_ids, seq.draft_token_ids) == (1 + len(drafts), drafts, [])
    return sched.update(out, ModelRunnerOutput([seq.seq_id], committed[:1], [None],
                                               spec_token_ids={seq.seq_id: committed},
                                               spec_logprobs={seq.seq_id: [None] * len(committed)}))


def test_scheduler_rolls_back_rejected_drafts_and_hashes_only_committed_tokens():
    sched = make_scheduler(num_blocks=16, block_size=4)
    seq = make_seq(0, [1, 2, 3, 4, 5, 6], max_tokens=20, stop_token_ids=[42])
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput([0], [7], [None]))
    bm = sched.block_manager
    # Positions 6..9 hold 7, 8, 9, 10; 9 is rejected (the target drew 11 there): 8 positions are computed and
    # block 1 = tokens [5, 6, 7, 8] is hashed from committed tokens; slots of 8..9 are rewritten later.
    assert _verify_step(sched, seq, [8, 9, 10], [8, 11]) == []
    assert seq.output_token_ids == [7, 8, 11] and seq.num_computed_tokens == 8
    assert bm.num_registered_blocks(seq) == 2 and len(seq.block_table) == 3
    assert bm.block_hashes(seq, 2)[1] == hash_block(hash_block(b"", [1, 2, 3, 4]), [5, 6, 7, 8])
    # All accepted, then a stop token inside the run: the request ends exactly there.
    assert _verify_step(sched, seq, [12, 13, 14], [12, 13, 14, 15]) == []
    assert seq.num_computed_tokens == 12 and bm.num_registered_blocks(seq) == 3
    assert _verify_step(sched, seq, [16, 42, 17], [16, 42, 17, 18]) == [seq]
    assert seq.output_token_ids[-3:] == [15, 16, 42] and seq.finish_reason == "stop"
    bm.check_invariants()
    assert bm.num_free_blocks == 16


def test_acceptance_rule_and_draft_policy():
    assert num_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted([5, 6, 7], [4, 6, 7, 1]) == 0
    assert num_accepted([5, 6, 7], [5, 6, 7, 1]) == 3
    policy = DraftPolicy(MTPConfig(max_draft_len=3, verify_token_cost=0.1, draft_step_cost=0.2, min_rows=4),
                         num_hidden_layers=8)
    assert [policy.max_drafts(left) for left in (1, 2, 3, 10)] == [0, 1, 2, 3]
    st = SpecStats(steps=2, rows=4, verify_rows=4, drafted=8, accepted=4, draft_forwards=4)
    # (1 + 4/4) / (1 + 0.1 * 8/4 + 0.2 * 4/2) = 2 / 1.6
    assert policy.estimated_speedup(st) == pytest.approx(1.25) and not policy.should_disable(st)
    st.accepted = 0
    assert policy.should_disable(st)
    assert DraftPolicy(MTPConfig(), num_hidden_layers=8).draft_step_cost == pytest.approx(0.2)
    with pytest.raises(ValueError, match="max_draft_len=0"):
        MTPConfig(max_draft_len=0)


@pytest.mark.gpu
def test_mtp_is_byte_identical_on_cuda_in_bfloat16(ckpts, sampled_case):
    """The GPU's batch-invariant kernels: a verify row's logits equal a decode row's, so bytes match too."""
    prompts, params, _ = sampled_case
    # A fixed cache: earlier GPU tests of the session may still hold device memory.
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512)
    plain, _ = _run(ckpts["random"], prompts, params, **kw)
    got, stats = _run(ckpts["random"], prompts, params, speculative_mtp=EAGER, **kw)
    assert got == plain and stats["spec_drafted_tokens"] > 0
