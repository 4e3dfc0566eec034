"""GPU: the Triton MLA kernels (mla_decode, head_proj, store_mla) at DeepSeek shapes, against the plain
references, and bitwise invariance of a token's result to batch, prefill/decode split and split groups."""

from __future__ import annotations

import functools

import pytest
import torch
from deepinfer.kernels.reference.mla import store_mla_ref
from deepinfer.kernels.reference.mla_decode import head_proj_ref, mla_decode_ref

from tests.support.paged_batches import (
    SeqStep,
    build_metadata,
    check_rows_bitwise,
    gather_rows,
    random_block_lists,
    rows_by_position,
)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
RANK, ROPE, BLOCK = 512, 64, 16
# bf16: inputs rounded alike; the kernel rounds P to bf16 before P @ V (as paged_attention) and its output.
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def mk():
    from deepinfer.kernels import mla_decode

    return mla_decode


def _setup(lens, heads, dtype, seed=0):
    blocks, num_blocks = random_block_lists(lens, BLOCK, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"), dtype=dtype, device=CUDA)
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], BLOCK, CUDA)
    entries = torch.randn(sum(lens), RANK + ROPE, generator=gen).to(dtype).to(CUDA)
    cache.view(-1, RANK + ROPE)[fill.slot_mapping] = entries
    q = [(torch.randn(n, heads, RANK + ROPE, generator=gen) * 0.05).to(dtype).to(CUDA) for n in lens]
    return blocks, q, cache


def _run(mk, blocks, q, cache, rows, policy=None):
    meta = build_metadata([SeqStep(blocks[b], ctx, ctx - lo) for b, lo, ctx in rows], BLOCK, CUDA)
    qs = gather_rows(q, rows)
    kw = {} if policy is None else {"policy": policy}
    return mk.mla_decode(qs, cache, meta, 0.07, RANK, **kw), meta, qs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [16, 128, 5])
def test_mla_decode_matches_reference(mk, dtype, heads):
    lens = [1500, 700, 33]                       # 1, 2 and 4 splits in deterministic mode
    blocks, q, cache = _setup(lens, heads, dtype)
    rows = [(0, 1499, 1500), (1, 600, 700), (2, 0, 33)]
    for policy in (mk.DETERMINISTIC_SPLITS, mk.NO_SPLIT, mk.SplitPolicy(min_tiles=2, max_splits=16)):
        out, meta, qs = _run(mk, blocks, q, cache, rows, policy)
        ref = mla_decode_ref(qs, cache, meta, 0.07, RANK)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_mla_decode_is_bitwise_invariant_to_scheduling(mk, monkeypatch):
    """A token's latent output is the same bits decoded alone, decoded in a batch, computed inside a full
    prefill or a prefill chunk, and with the scratch cut into several launch groups."""
    lens = [1300, 600, 90]
    blocks, q, cache = _setup(lens, 16, torch.bfloat16, seed=3)
    full, *_ = _run(mk, blocks, q, cache, [(b, 0, n) for b, n in enumerate(lens)])
    want = rows_by_position(full, lens)
    check = functools.partial(check_rows_bitwise, want)   # check(rows, out, label)

    for rows in ([(0, 1299, 1300)], [(0, 1299, 1300), (1, 599, 600), (2, 89, 90)],
                 [(2, 89, 90), (0, 700, 701), (1, 511, 512)], [(1, 512, 513)]):
        check(rows, _run(mk, blocks, q, cache, rows)[0], f"decode {rows}")
    for rows in ([(0, 0, 517), (2, 40, 41)], [(0, 517, 1300)], [(1, 255, 600), (0, 1000, 1001)]):
        check(rows, _run(mk, blocks, q, cache, rows)[0], f"chunk {rows}")
    from deepinfer.kernels import split_combine
    monkeypatch.setattr(split_combine, "SCRATCH_BUDGET_BYTES", 3 << 20)
    rows = [(0, 0, 1300), (1, 0, 600)]
    check(rows, _run(mk, blocks, q, cache, rows)[0], "small scratch budget")


def test_head_proj_matches_reference_and_is_row_invariant():
    from deepinfer.kernels.mla_proj import head_proj

    gen = torch.Generator().manual_seed(1)
    heads, nope, v = 16, 128, 128
    kv_b = (torch.randn(heads * (nope + v), RANK, generator=gen) * 0.05).bfloat16().to(CUDA)
    w = kv_b.view(heads, nope + v, RANK)
    w_uk_t, w_uv = w[:, :nope].transpose(1, 2), w[:, nope:]
    x = torch.randn(300, heads, nope, generator=gen).bfloat16().to(CUDA)
    lat = head_proj(x, w_uk_t)
    torch.testing.assert_close(lat.float(), head_proj_ref(x, w_uk_t).float(), atol=2e-2, rtol=2e-2)
    o = head_proj(lat, w_uv)
    for m, start in ((1, 0), (7, 100), (64, 236)):
        assert torch.equal(head_proj(x[start:start + m].contiguous(), w_uk_t), lat[start:start + m])
        assert torch.equal(head_proj(lat[start:start + m].contiguous(), w_uv), o[start:start + m])


def test_store_mla_matches_reference_and_skips_padding():
    from deepinfer.kernels.store_mla import store_mla

    kv = torch.randn(9, RANK + ROPE + 32, device=CUDA).bfloat16()    # strided views, as the layer passes
    latent, k_pe = kv[:, :RANK], kv[:, RANK:RANK + ROPE]
    slots = torch.tensor([17, 18, 19, -1, 40, 41, 5, 95, -1], device=CUDA)
    a = torch.full((6, BLOCK, RANK + ROPE), 7.0, device=CUDA).bfloat16()
    b = a.clone()
    store_mla(latent, k_pe, a, slots)
    store_mla_ref(latent, k_pe, b, slots)
    assert torch.equal(a, b) and int((a != 7.0).any(-1).sum()) == 7
