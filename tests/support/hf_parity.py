"""What the HF-parity tests of the engine's models share: random prompts, the engine's model on CPU in
float32, and transformers' own prefill + greedy decode logits through its cache (the reference)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.loader import iter_weights
from deepinfer.engine.models.registry import build_model


def random_prompts(n: int, vocab: int, seed: int, shared_prefix: int = 0, lo: int = 3, hi: int = 60
                   ) -> list[list[int]]:
    """`n` prompts of lo..hi random ids (>= 10, clear of special tokens) after `shared_prefix` common ids."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def cpu_engine_model(path: str | Path, deterministic: bool = True) -> tuple[ModelConfig, torch.nn.Module]:
    """The engine's model of the checkpoint at `path` on CPU in float32, weights loaded."""
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, make_ops("cpu", deterministic), torch.float32, "cpu")
    model.load_weights(iter_weights(path, "cpu"))
    return cfg, model


def hf_step_logits(model, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill logits [n, V], then each greedy decode step's [1, V] through transformers' own cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]]
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0])
    return logits, tokens


def check_chunked_prefill_and_decode(model: torch.nn.Module, cfg, hf_model, a: list[int], b: list[int],
                                     a_chunks: list[int], steps: int) -> None:
    """Two sequences through a PagedBatchRunner: `a` prefilled in chunks of `a_chunks` tokens (the first
    beside all of `b`), then `steps` batched greedy decode steps on HF's tokens; every row within 1e-4 of
    transformers' own logits (`hf_step_logits`)."""
    from tests.support.paged_runner import PagedBatchRunner

    assert sum(a_chunks) == len(a), (a_chunks, len(a))
    ref_a, toks_a = hf_step_logits(hf_model, a, steps)
    ref_b, toks_b = hf_step_logits(hf_model, b, steps)
    runner = PagedBatchRunner(model, cfg)
    runner.add("a", a)
    runner.add("b", b)
    first = runner.step([("a", a_chunks[0]), ("b", len(b))])
    parts = [first["a"]] + [runner.step([("a", n)])["a"] for n in a_chunks[1:]]
    torch.testing.assert_close(torch.cat(parts), ref_a[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(first["b"], ref_b[0], atol=1e-4, rtol=0)
    for step in range(steps):
        runner.append("a", toks_a[step])
        runner.append("b", toks_b[step])
        got = runner.step([("b", 1), ("a", 1)])
        torch.testing.assert_close(got["a"], ref_a[step + 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(got["b"], ref_b[step + 1], atol=1e-4, rtol=0)
