"""The GPU tests' shared harness for models on CUDA and their bitwise checks (tests/engine/test_models_gpu.py,
test_deepseek_gpu.py, test_gpu_determinism.py): a model built and loaded on the device, one prompt's logits
alone / in a batch / chunked, and an engine's outputs across batch sizes, chunked prefill and prefix hits.

Every check compares with torch.equal or ==: batch invariance is a bitwise property, no tolerance applies.
"""

from __future__ import annotations

import gc

import torch
from deepinfer.engine.models.config import ModelConfig

from tests.support.paged_runner import PagedBatchRunner

CUDA = torch.device("cuda")
Outputs = dict[int, tuple]


def cuda_model(path, deterministic: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig]:
    """The checkpoint at `path` built with the CUDA ops (`deterministic`: the batch-invariant kernels) and
    loaded on the device; returns (model, its config)."""
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, make_ops(CUDA, deterministic), dtype, CUDA)
    model.load_weights(iter_weights(path, CUDA))
    return model, cfg


def check_logits_batch_invariant(model: torch.nn.Module, cfg: ModelConfig, prompts: list[list[int]]) -> None:
    """prompts[0]'s prefill logits are bitwise the same alone, in one batch with all of `prompts` (in
    reverse order), and chunked (7 + 16 + 17 tokens) beside prompts[4] (at least 200 tokens) in 100 + 50 +
    50 token pieces. `prompts[0]` must be 40 tokens long."""
    target = prompts[0]
    alone = PagedBatchRunner(model, cfg, num_blocks=64)
    alone.add("t", target)
    ref = alone.step([("t", len(target))])["t"]

    batched = PagedBatchRunner(model, cfg, num_blocks=64)
    for i, p in enumerate(prompts):
        batched.add(f"s{i}", p)
    in_batch = batched.step([(f"s{i}", len(p)) for i, p in reversed(list(enumerate(prompts)))])["s0"]

    chunked = PagedBatchRunner(model, cfg, num_blocks=64)
    chunked.add("t", target)
    chunked.add("o", prompts[4])
    parts = [chunked.step([("o", n), ("t", m)])["t"] for n, m in [(100, 7), (50, 16), (50, 17)]]
    assert torch.equal(in_batch, ref)
    assert torch.equal(torch.cat(parts), ref)


def cuda_llm(path, **kw):
    """An engine (bfloat16, CUDA, seed 0, `kw`) over the checkpoint at `path`, after the previous engine's
    weights and cache are gone from the device (they must be before sizing this one)."""
    from deepinfer.engine import LLM

    gc.collect()
    torch.cuda.empty_cache()
    return LLM(model=str(path), dtype="bfloat16", device="cuda", seed=0, **kw)


def run_requests(llm, prompts: list[list[int]], params: list, idx: list[int]) -> Outputs:
    """Requests `idx` generated in one call: {i: (token ids, logprobs)}."""
    outs = llm.generate([prompts[i] for i in idx], [params[i] for i in idx], use_tqdm=False)
    return {i: (o.token_ids, o.logprobs) for i, o in zip(idx, outs)}


def check_batch_sizes(llm, prompts: list[list[int]], params: list, ref: Outputs, sizes: tuple[int, ...],
                      start: int) -> None:
    """Requests start .. start + size - 1, generated alone as a batch of each size, give `ref`'s outputs."""
    for size in sizes:
        idx = list(range(start, start + size))
        got = run_requests(llm, prompts, params, idx)
        assert got == {i: ref[i] for i in idx}, f"batch size {size} differs"


def check_chunked_and_prefix_hits(chunked, prompts: list[list[int]], params: list, ref: Outputs,
                                  idx: list[int]) -> None:
    """An engine with chunked prefill and prefix caching gives `ref`'s outputs for `idx`, and again when
    run a second time (prefix-cache hits on every shared block)."""
    first = run_requests(chunked, prompts, params, idx)
    again = run_requests(chunked, prompts, params, idx)
    assert first == {i: ref[i] for i in idx}, "chunked prefill differs"
    assert again == first, "prefix-cache hits differ"
