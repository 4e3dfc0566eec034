"""deepinfer's models match Hugging Face transformers, and the deterministic ops are batch-invariant.

Each tiny random-weight checkpoint is run (CPU, float32) by transformers and by deepinfer's model over a
paged KV cache: batched varlen prefill, decode steps and chunked prefill must reproduce HF's logits, and in
deterministic mode a token's logits must be bitwise identical however its batch was composed.
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.loader import iter_weights, resolve_dtype
from deepinfer.engine.models.registry import build_model

from tests.support.paged_runner import PagedBatchRunner
from tests.support.tiny_models import TINY_ARCHS

ATOL = 1e-4
MODES = [pytest.param(True, id="deterministic"), pytest.param(False, id="fast")]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32)
            cache[arch] = model.eval()
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def our_model(tiny_checkpoint):
    def get(arch: str, deterministic: bool):
        path = tiny_checkpoint(arch)
        cfg = ModelConfig.from_dir(path)
        model = build_model(cfg, make_ops("cpu", deterministic), torch.float32, torch.device("cpu"))
        model.load_weights(iter_weights(path, "cpu"))
        return model, cfg

    return get


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_prefill_matches_hf_per_prompt(arch, deterministic, hf_model, our_model):
    model, cfg = our_model(arch, deterministic)
    prompts = _prompts(cfg.vocab_size, [5, 37, 18], seed=1)  # within, across and beyond 16-token chunks
    runner = PagedBatchRunner(model, cfg)
    for i, p in enumerate(prompts):
        runner.add(f"s{i}", p)
    logits = runner.step([(f"s{i}", len(p)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf_model(arch), p)
        assert logits[f"s{i}"].shape == ref.shape
        assert _max_diff(logits[f"s{i}"], ref) <= ATOL


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decode_steps_through_paged_cache_match_hf(arch, deterministic, hf_model, our_model):
    model, cfg = our_model(arch, deterministic)
    prompts = _prompts(cfg.vocab_size, [14, 3, 30], seed=2)
    new_tokens = _prompts(cfg.vocab_size, [6, 6, 6], seed=3)
    runner = PagedBatchRunner(model, cfg)
    for i, p in enumerate(prompts):
        runner.add(f"s{i}", p)
    runner.step([(f"s{i}", len(p)) for i, p in enumerate(prompts)])
    decoded = {f"s{i}": [] for i in range(len(prompts))}
    for t in range(6):
        # Sequence s1 joins the decode batch late (t >= 2): batches of different sizes.
        keys = [k for k in decoded if k != "s1" or t >= 2]
        for k in keys:
            runner.append(k, new_tokens[int(k[1:])][len(decoded[k])])
        out = runner.step([(k, 1) for k in keys])
        for k in keys:
            decoded[k].append(out[k][0])
    for i, p in enumerate(prompts):
        full = p + new_tokens[i][: len(decoded[f"s{i}"])]
        ref = _hf_logits(hf_model(arch), full)
        # decoded[j] is the logits after feeding full[len(p) + j]
        ours = torch.stack(decoded[f"s{i}"])
        assert _max_diff(ours, ref[len(p):]) <= ATOL


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_token_logits_do_not_depend_on_batch_or_prefill_split(arch, deterministic, our_model):
    """Deterministic ops: bitwise equal logits however the work is split. Fast ops: equal within ATOL."""
    model, cfg = our_model(arch, deterministic)
    prompts = _prompts(cfg.vocab_size, [40, 9, 23, 33, 2, 17], seed=4)
    target = prompts[0]

    alone = PagedBatchRunner(model, cfg)
    alone.add("t", target)
    ref = alone.step([("t", len(target))])["t"]

    batched = PagedBatchRunner(model, cfg)
    for i, p in enumerate(prompts):
        batched.add(f"s{i}", p)
    in_batch = batched.step([(f"s{i}", len(p)) for i, p in reversed(list(enumerate(prompts)))])["s0"]

    # Chunked prefill: 7, 16, 1 and 16 tokens per step (crossing chunk and block boundaries), with other
    # sequences' prefills and decodes in the same steps.
    chunked = PagedBatchRunner(model, cfg)
    chunked.add("t", target)
    for i, p in enumerate(prompts[1:4]):
        chunked.add(f"o{i}", p)
    steps = [[("o0", 9), ("t", 7)], [("o1", 23), ("t", 16)], [("o0", 1), ("t", 1)], [("o2", 33), ("t", 16)]]
    parts = []
    for work in steps:
        if work[0] == ("o0", 1):
            chunked.append("o0", 5)  # o0 decodes beside the target's one-token chunk
        parts.append(chunked.step(work)["t"])
    split = torch.cat(parts)

    # Decode path: feed the last prompt token as a one-token step after a prefill of the rest.
    decode = PagedBatchRunner(model, cfg)
    decode.add("t", target)
    decode.add("x", prompts[5])
    decode.step([("t", len(target) - 1), ("x", 17)])
    decode.append("x", 7)
    last = decode.step([("x", 1), ("t", 1)])["t"]

    for other in (in_batch, split):
        assert other.shape == ref.shape
    if deterministic:
        assert torch.equal(in_batch, ref)
        assert torch.equal(split, ref)
        assert torch.equal(last[0], ref[-1])
    else:
        assert _max_diff(in_batch, ref) <= ATOL
        assert _max_diff(split, ref) <= ATOL
        assert _max_diff(last[0], ref[-1]) <= ATOL


# bfloat16 logits of magnitude ~3 have a resolution of 1/64; deepinfer attends in float32 where transformers
# stays in bfloat16, so they differ by a few units in the last place.
BF16_ATOL = 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_checkpoint_loads_as_bfloat16_and_tracks_hf(arch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch, dtype=torch.bfloat16)
    cfg = ModelConfig.from_dir(path)
    dtype = resolve_dtype("auto", cfg)
    assert dtype == torch.bfloat16
    model = build_model(cfg, make_ops("cpu", True), dtype, torch.device("cpu"))
    model.load_weights(iter_weights(path, "cpu"))
    runner = PagedBatchRunner(model, cfg)
    prompt = _prompts(cfg.vocab_size, [40], seed=5)[0]
    runner.add("a", prompt)
    ours = runner.step([("a", len(prompt))])["a"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert _max_diff(ours, _hf_logits(hf, prompt)) <= BF16_ATOL
