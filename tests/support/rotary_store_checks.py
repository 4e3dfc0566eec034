"""GPU checks shared by the fused rotary + KV-store kernel's tests (tests/kernels/test_rotary_store_gpu.py for
the model-dtype cache, test_rotary_store_fp8_gpu.py for the e4m3 one): engine cos/sin rows for a case, the
bitwise batch-invariance and CUDA-graph checks, and a model's logits with and without the fused kernel.

The two cache forms differ only in how a case is built (`fresh`: a case's operands with fresh caches), how
cache bytes are compared (`view`: identity, or the raw bits of an e4m3 cache, whose NaN bytes torch.equal
would never call equal) and, for the model check, what the runner's caches and the layers' scales are
(`prepare`); everything else is one piece of code here.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from deepinfer.engine.models.config import RopeScaling

Case = dict
View = Callable[[torch.Tensor], torch.Tensor]
DEV = "cuda"
BF16 = torch.bfloat16
_MAX_POSITION = 131072


def compiled_kernels(*names: str) -> tuple[ModuleType, ...]:
    """The modules deepinfer.kernels.<name>, for a module fixture; skips under TRITON_INTERPRET=1 (these
    checks need compiled kernels)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    return tuple(importlib.import_module(f"deepinfer.kernels.{name}") for name in names)


def _same(view: View | None) -> Callable[[torch.Tensor, torch.Tensor], bool]:
    return torch.equal if view is None else (lambda a, b: torch.equal(view(a), view(b)))


def with_engine_rotary(case: Case, head_dim: int, theta: float, scaling: RopeScaling | None,
                       dtype: torch.dtype, seed: int) -> Case:
    """`case` (q/k/v/caches of len(q) tokens on the GPU) with cos/sin rows from the engine's own rotary
    table, at random positions up to 128k (seeded by seed + 1)."""
    from deepinfer.engine.layers.rotary import RotaryEmbedding

    num_tokens = case["q"].shape[0]
    rope = RotaryEmbedding(head_dim, _MAX_POSITION, theta, scaling, device=torch.device(DEV))
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, _MAX_POSITION, (num_tokens,), generator=gen).to(DEV)
    cos, sin = rope(positions, dtype)
    case.update(cos=cos.squeeze(1), sin=sin.squeeze(1))
    return case


def check_token_bits_batch_invariant(fused: Callable[..., torch.Tensor], c: Case,
                                     fresh: Callable[[Case], Case], view: View | None = None) -> None:
    """Every window of 1, 7, 64 and 256 tokens (at the start and at the end of `c`) gives the q rows and the
    cache slots that the whole batch gives, bitwise."""
    same = _same(view)
    n = c["q"].shape[0]
    full = fresh(c)
    q_full = fused(**full)
    bs = c["k_cache"].shape[1]
    names = ("q", "k", "v", "cos", "sin", "slot_mapping")
    for size in (1, 7, 64, 256):
        for lo in (0, n - size):
            part = fresh({**c, **{name: c[name][lo:lo + size] for name in names}})
            assert torch.equal(fused(**part), q_full[lo:lo + size]), (size, lo)
            slots = c["slot_mapping"][lo:lo + size]
            slots = slots[slots >= 0].long()
            blk, off = slots // bs, slots % bs
            assert same(part["k_cache"][blk, off], full["k_cache"][blk, off]), (size, lo)
            assert same(part["v_cache"][blk, off], full["v_cache"][blk, off]), (size, lo)


def check_captures_into_a_cuda_graph(fused: Callable[..., torch.Tensor], c: Case,
                                     fresh: Callable[[Case], Case], view: View | None = None) -> None:
    """A replay of a captured launch writes the q and the caches an eager launch writes."""
    same = _same(view)
    want = fresh(c)
    q_want = fused(**want)
    got = fresh(c)
    fused(**fresh(c))          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = fused(**got)
    got["k_cache"].copy_(c["k_cache"])
    got["v_cache"].copy_(c["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, q_want)
    assert same(got["k_cache"], want["k_cache"]) and same(got["v_cache"], want["v_cache"])


def check_model_logits_with_and_without_fused_rope(
    rotary_store: ModuleType, arch: str, path, monkeypatch,
    prepare: Callable[[torch.nn.Module, object], None] | None = None, finite: bool = False,
) -> None:
    """A tiny `arch` checkpoint at `path` on CUDA: a prefill of three prompts and three decode steps give
    the same logits, bitwise, with DEEPINFER_DISABLE_FUSED_ROPE=1 and with the fused kernel (launched once
    a layer a step). `prepare(model, runner)` may set the runner's caches and the layers' scales first;
    `finite` also requires every logit to be finite."""
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.layers.cuda_ops import DISABLE_FUSED_ROPE_ENV
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model

    from tests.support.paged_runner import PagedBatchRunner

    cfg = ModelConfig.from_dir(path)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 37, 18)]
    calls = []
    fused = rotary_store.rotary_store_kv
    monkeypatch.setattr(rotary_store, "rotary_store_kv", lambda *a: calls.append(1) or fused(*a))
    logits = {}
    for disabled in ("1", ""):
        calls.clear()
        monkeypatch.setenv(DISABLE_FUSED_ROPE_ENV, disabled)
        ops = make_ops(DEV, deterministic=True)
        assert ops.fused_rope is (disabled != "1")
        model = build_model(cfg, ops, BF16, torch.device(DEV))
        model.load_weights(iter_weights(path, torch.device(DEV)))
        runner = PagedBatchRunner(model, cfg)
        if prepare is not None:
            prepare(model, runner)
        for i, p in enumerate(prompts):
            runner.add(f"s{i}", p)
        steps = [runner.step([(f"s{i}", len(p)) for i, p in enumerate(prompts)])]
        for t in range(3):
            for i in range(3):
                runner.append(f"s{i}", (7 * t + i) % cfg.vocab_size)
            steps.append(runner.step([(f"s{i}", 1) for i in range(3)]))
        logits[disabled] = steps
        assert len(calls) == (0 if disabled else 4 * cfg.num_hidden_layers)   # 4 steps, one launch a layer
    for step_fused, step_unfused in zip(logits[""], logits["1"]):
        for name in step_fused:
            if finite:
                assert torch.isfinite(step_fused[name]).all(), f"{arch} {name}"
            assert torch.equal(step_fused[name], step_unfused[name]), f"{arch} {name}"
