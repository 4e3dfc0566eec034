"""kernels/mla_decode.py and kernels/mla_proj.py on CPU under Triton's interpreter, tiny shapes.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_mla_decode_cpu.py starts one).
Checks agreement with the plain references in kernels/reference/mla_decode.py for prefill, decode, chunked
and prefix-hit steps, with one and several KV splits (including the scratch being cut into launch groups),
and the argument checks, in float32; in bfloat16 (interpreter patched to the GPU's bf16 dot and rounding,
tests/kernels/interpreter_bf16.py) that the kernels lose no precision beyond the one final rounding.
Bitwise batch invariance is checked on the GPU (test_mla_decode_gpu.py): the interpreter's host matmuls are
not guaranteed row-invariant.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from deepinfer.kernels.reference.mla_decode import head_proj_ref, mla_decode_ref
from deepinfer.kernels.split_plan import get_host_plan

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import SeqStep, build_metadata, gather_rows, random_block_lists

skip_unless_interpreting("tests/kernels/test_mla_decode_cpu.py")

RANK, ROPE, HEADS, BLOCK = 32, 8, 4, 16


@pytest.fixture(scope="module")
def mla():
    return interpreted_kernels("mla_decode", "_mla_split_kernel")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _setup(lens, heads=HEADS, seed=0):
    """Per-sequence q_abs rows and a NaN-filled latent cache holding every position's entry."""
    blocks, num_blocks = random_block_lists(lens, BLOCK, seed=seed)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"))
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], BLOCK)
    entries = _rand(sum(lens), RANK + ROPE, seed=seed + 1)
    slots = fill.slot_mapping
    cache.view(-1, RANK + ROPE)[slots] = entries
    q = [_rand(n, heads, RANK + ROPE, seed=seed + 10 + b) for b, n in enumerate(lens)]
    return blocks, q, cache


def _step(blocks, q, rows):
    meta = build_metadata([SeqStep(blocks[b], ctx, ctx - lo) for b, lo, ctx in rows], BLOCK)
    return meta, gather_rows(q, rows)


@pytest.mark.parametrize("policy", ["deterministic", "two_tile_splits", "none"])
@pytest.mark.parametrize("lens,rows", [
    ([37, 40], [(0, 22, 37), (1, 0, 40)]),                  # prefix hit + full prefill
    ([45, 83, 9], [(0, 44, 45), (1, 82, 83), (2, 8, 9)]),   # decode
    ([70, 20], [(0, 57, 70), (1, 19, 20)]),                 # prefill chunk beside a decode row
])
def test_mla_decode_matches_reference(mla, policy, lens, rows):
    pol = {"deterministic": mla.DETERMINISTIC_SPLITS, "none": mla.NO_SPLIT,
           "two_tile_splits": mla.SplitPolicy(min_tiles=2, max_splits=3)}[policy]
    blocks, q, cache = _setup(lens, seed=len(lens))
    meta, qs = _step(blocks, q, rows)
    out = mla.mla_decode(qs, cache, meta, 0.2, RANK, policy=pol)
    ref = mla_decode_ref(qs, cache, meta, 0.2, RANK)
    assert out.shape == (qs.shape[0], HEADS, RANK) and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_scratch_is_cut_into_groups_without_changing_results(mla, monkeypatch):
    lens = [50, 36]
    blocks, q, cache = _setup(lens, heads=20, seed=5)        # 20 heads: two head blocks, one partial
    rows = [(0, 44, 50), (1, 30, 36)]
    pol = mla.SplitPolicy(min_tiles=1, max_splits=4)
    meta, qs = _step(blocks, q, rows)
    whole = mla.mla_decode(qs, cache, meta, 0.3, RANK, policy=pol)
    slot = 20 * (RANK + 2) * 4
    from deepinfer.kernels import split_combine
    monkeypatch.setattr(split_combine, "SCRATCH_BUDGET_BYTES", 7 * slot)
    meta2, _ = _step(blocks, q, rows)
    cfg = mla.mla_tile_config(20, RANK, ROPE, torch.float32)
    plan = get_host_plan(meta2, cfg["BLOCK_Q"], cfg["BLOCK_N"], pol, slot, split_combine.SCRATCH_BUDGET_BYTES,
                         qs.device)
    assert len(plan.groups) > 3 and all(g.num_slots <= 7 or g.entry_hi - g.entry_lo == 1 for g in plan.groups)
    cut = mla.mla_decode(qs, cache, meta2, 0.3, RANK, policy=pol)
    torch.testing.assert_close(cut, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cut, mla_decode_ref(qs, cache, meta2, 0.3, RANK), atol=3e-5, rtol=3e-5)


def test_split_layout_depends_on_position_only(mla):
    import numpy as np
    from deepinfer.kernels.split_plan import split_counts

    pos = np.arange(0, 5000)
    counts = split_counts(pos, 32, mla.DETERMINISTIC_SPLITS.min_tiles, mla.DETERMINISTIC_SPLITS.max_splits)
    assert counts[:512].max() == 1 and counts[512] == 2 and counts.max() == 4
    assert (np.diff(counts) >= 0).all()
    assert "meta" not in mla.mla_tile_config.__code__.co_varnames


@pytest.mark.parametrize("t,h,n,k", [(1, 4, 32, 16), (37, 3, 40, 48), (70, 2, 16, 80)])
def test_head_proj_matches_reference_on_strided_views(t, h, n, k):
    proj = importlib.import_module("deepinfer.kernels.mla_proj")
    x = _rand(t, h, k, seed=t)
    w_full = _rand(h * (n + 8), k + 3, seed=k)               # strided views, as of kv_b_proj.weight
    w = w_full.view(h, n + 8, k + 3)[:, 8:, 3:]
    got = proj.head_proj(x, w)
    torch.testing.assert_close(got, head_proj_ref(x, w), atol=1e-5, rtol=1e-5)
    buf = torch.zeros(t, h, n + 5)
    proj.head_proj(x, w, out=buf[:, :, :n])
    torch.testing.assert_close(buf[:, :, :n], got, atol=0, rtol=0)
    assert (buf[:, :, n:] == 0).all()


@pytest.mark.parametrize("policy", ["deterministic", "three_splits"])
def test_bf16_mla_decode_keeps_fp32_intermediates(mla, monkeypatch, policy):
    """bf16 in and out: scores, softmax, partials and the split merge stay fp32, so the kernel is as close
    to the exact (fp32) result as the reference rounded once; only P is rounded to bf16 for the P @ V MMA
    (as in HF's bf16 attention). A bf16 scratch for the split partials fails this (mean error x1.3)."""
    gpu_like_bf16(monkeypatch)
    pol = {"deterministic": mla.DETERMINISTIC_SPLITS, "three_splits": mla.SplitPolicy(1, 3)}[policy]
    bf = torch.bfloat16
    lens, rows = [70, 45], [(0, 60, 70), (1, 44, 45)]            # a prefill chunk and a decode row
    blocks, num_blocks = random_block_lists(lens, BLOCK, seed=1)
    cache = torch.zeros(num_blocks, BLOCK, RANK + ROPE, dtype=bf)
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], BLOCK)
    cache.view(-1, RANK + ROPE)[fill.slot_mapping] = _rand(sum(lens), RANK + ROPE, seed=2).to(bf)
    q = [(2 * _rand(n, HEADS, RANK + ROPE, seed=10 + b)).to(bf) for b, n in enumerate(lens)]
    meta, qs = _step(blocks, q, rows)
    exact = mla_decode_ref(qs.float(), cache.float(), meta, 0.3, RANK)
    once = (mla_decode_ref(qs, cache, meta, 0.3, RANK).float() - exact).abs()
    out = mla.mla_decode(qs, cache, meta, 0.3, RANK, policy=pol)
    assert out.dtype == bf
    err = (out.float() - exact).abs()
    assert err.mean() <= 1.2 * once.mean(), (err.mean(), once.mean())
    assert err.max() <= 1.5 * once.max(), (err.max(), once.max())


def test_bf16_head_proj_rounds_once(monkeypatch):
    gpu_like_bf16(monkeypatch)
    proj = importlib.import_module("deepinfer.kernels.mla_proj")
    x = _rand(37, 3, 48, seed=3).to(torch.bfloat16)
    w = (_rand(3 * 40, 50, seed=4) / 7).to(torch.bfloat16).view(3, 40, 50)[:, :, 2:]
    got = proj.head_proj(x, w)
    want = head_proj_ref(x, w)                                   # fp32 accumulation, one rounding
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order may round across a bf16 tie: at most one bf16 ulp, rarely
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("q_shape,cache_shape,rank,match", [
    ((3, 4, 40), (6, 16, 48), 32, "entry width"),
    ((3, 4, 40), (6, 8, 40), 32, "block_size"),
    ((2, 4, 40), (6, 16, 40), 32, "tokens"),
    ((3, 4, 40), (6, 16, 40), 24, "power of two"),
])
def test_mla_decode_rejects_inconsistent_inputs(mla, q_shape, cache_shape, rank, match):
    meta = build_metadata([SeqStep([1], 3, 3)], 16)
    with pytest.raises(ValueError, match=match):
        mla.mla_decode(torch.zeros(q_shape), torch.zeros(cache_shape), meta, 1.0, rank)


def test_mla_decode_rejects_mixed_dtypes(mla):
    meta = build_metadata([SeqStep([1], 3, 3)], 16)
    with pytest.raises(ValueError, match="dtype"):
        mla.mla_decode(torch.zeros(3, 4, 40), torch.zeros(6, 16, 40, dtype=torch.float16), meta, 1.0, 32)


def test_cuda_ops_run_a_tiny_deepseek_v3_like_transformers(tmp_path):
    """The CUDA backend's DeepSeek path (store_mla, head_proj, mla_decode, fused_moe and the other Triton
    kernels) on the interpreter, float32: a prefill chunk, the rest of the prompt, a decode step."""
    from tests.support.paged_runner import check_cuda_ops_against_transformers
    from tests.support.tiny_deepseek import make_tiny_deepseek

    path = make_tiny_deepseek("v3", tmp_path / "v3")
    check_cuda_ops_against_transformers(path, [5 + i for i in range(14)], [40 + 3 * i for i in range(6)],
                                        first=9)
