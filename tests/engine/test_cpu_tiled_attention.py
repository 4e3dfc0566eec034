"""The CPU deterministic attention's GEMM tiles (kernels/reference/tiled_attention.py).

A token's bits must not depend on the other sequences of its batch, the batch size, where its prompt was
split into prefill chunks (so whether it sits in a 32-token tile or alone in a one-token tile), or padding
rows, keys and matrices; and the result must be attention (checked against the plain reference).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference import tiled_attention as ta
from deepinfer.kernels.reference.attention import chunked_paged_attention, paged_attention_ref

from tests.engine.test_cpu_ops import _paged_batch

INV = make_ops("cpu", deterministic=True)
# On a BLAS where the probes reject every tiling the op runs chunked_paged_attention (tested in
# test_cpu_ops.py); these tests are about the tiles themselves.
pytestmark = pytest.mark.skipif(ta.tile_sizes(3, 16) is None, reason="no GEMM tiling passes its probe here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class _Cache:
    """Random paged caches holding sequences of the given lengths (blocks in shuffled order)."""

    def __init__(self, lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-n // block_size) for n in lengths]
        perm = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
        shape = (len(perm), block_size, num_kv_heads, head_dim)
        self.k, self.v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        self.tables, self.block_size = [], block_size
        for b in blocks:
            self.tables.append([perm.pop() for _ in range(b)])

    def meta(self, runs: list[tuple[int, int, int]]) -> AttentionMetadata:
        """runs: (sequence, first new position, context after the step) per scheduled sequence."""
        bs = self.block_size
        tables = [self.tables[s] for s, _, _ in runs]
        width = max(map(len, tables))
        pos = [p for _, a, c in runs for p in range(a, c)]
        slots = [t[p // bs] * bs + p % bs for t, (_, a, c) in zip(tables, runs) for p in range(a, c)]
        qlens, slens = [c - a for _, a, c in runs], [c for _, _, c in runs]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), positions=torch.tensor(pos),
            query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(slens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            block_size=bs, max_query_len=max(qlens), max_seq_len=max(slens),
            query_lens_cpu=qlens, seq_lens_cpu=slens)


def _queries(lengths: list[int], num_q_heads: int, head_dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(n, num_q_heads, head_dim, generator=gen) for n in lengths]


def _run(cache: _Cache, qs: list[torch.Tensor], runs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    meta = cache.meta(runs)
    q = torch.cat([qs[s][a:c] for s, a, c in runs])
    out = ta.tiled_paged_attention(q, cache.k, cache.v, meta, 0.125)
    assert out is not None, "the probes rejected the tiling on this machine"
    return list(out.split(meta.query_lens_cpu))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1), (9, 3)])
def test_tiled_attention_matches_plain_attention(block_size, heads):
    seqs = [(70, 70), (5, 1), (140, 1), (33, 17), (16, 16), (90, 3)]
    k_cache, v_cache, meta = _paged_batch(seqs, block_size, heads[1], 16, seed=block_size + heads[0])
    q = torch.randn(meta.num_tokens, heads[0], 16, generator=torch.Generator().manual_seed(1))
    out = ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(INV.attention(q, k_cache, v_cache, meta, 0.25), out, atol=0, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("split", [1, 31, 32, 45, 69])
def test_token_bits_independent_of_batch_and_prefill_split(batch, split):
    lengths = [70, 3, 150, 33, 64, 1, 97, 40][:batch]
    cache = _Cache(lengths, 16, 3, 16, seed=batch)
    qs = _queries(lengths, 9, 16)
    whole = _run(cache, qs, [(0, 0, lengths[0])])[0]                  # sequence 0 alone, one prefill
    # The same prompt split into two steps, each beside other sequences' prefills and decodes.
    others = [(s, (n - 1) if s % 2 else 0, n) for s, n in enumerate(lengths) if s]
    first = _run(cache, qs, [*others, (0, 0, split)])[-1]
    second = _run(cache, qs, [(0, split, lengths[0]), *others[::-1]])[0]
    assert torch.equal(_bits(torch.cat([first, second])), _bits(whole))
    # Token by token (every token alone in a one-token tile), as decode steps would see them.
    for p in (0, split - 1, lengths[0] - 1):
        alone = _run(cache, qs, [*others, (0, p, p + 1)])[-1]
        assert torch.equal(_bits(alone[0]), _bits(whole[p])), f"position {p}"


def test_nan_in_slots_past_the_context_does_not_leak():
    cache = _Cache([40, 20], 16, 2, 16, seed=3)
    qs = _queries([40, 20], 4, 16)
    clean = _run(cache, qs, [(0, 0, 40), (1, 19, 20)])
    for table, n in zip(cache.tables, (40, 20)):  # poison every slot past each context
        for i, blk in enumerate(table):
            lo = max(0, n - i * 16)
            if lo < 16:
                cache.k[blk, lo:], cache.v[blk, lo:] = float("nan"), float("nan")
    poisoned = _run(cache, qs, [(0, 0, 40), (1, 19, 20)])
    for a, b in zip(clean, poisoned):
        assert torch.equal(_bits(a), _bits(b))


def test_bfloat16_cache_matches_plain_attention_and_is_split_invariant():
    cache = _Cache([50, 9], 16, 1, 16, seed=4)
    cache.k, cache.v = cache.k.bfloat16(), cache.v.bfloat16()
    qs = [q.bfloat16() for q in _queries([50, 9], 3, 16)]
    whole = _run(cache, qs, [(0, 0, 50), (1, 8, 9)])
    meta = cache.meta([(0, 0, 50), (1, 8, 9)])
    expected = paged_attention_ref(torch.cat([qs[0], qs[1][8:]]), cache.k, cache.v, meta, 0.125)
    torch.testing.assert_close(torch.cat(whole).float(), expected.float(), atol=2e-2, rtol=2e-2)
    alone = _run(cache, qs, [(0, 49, 50)])[0]
    assert torch.equal(_bits(alone[0]), _bits(whole[0][49]))


def test_zero_output_has_one_sign():
    k_cache, v_cache, meta = _paged_batch([(20, 20), (3, 1)], 16, 1, 16, seed=5)
    v_cache.zero_()
    v_cache.neg_()  # -0.0 everywhere
    out = ta.tiled_paged_attention(torch.randn(meta.num_tokens, 1, 16), k_cache, v_cache, meta, 0.25)
    assert not torch.signbit(out).any()


def test_probe_is_cached_and_failures_fall_back_to_one_definition(monkeypatch):
    assert ta.tile_sizes(3, 16) is not None
    assert any(key[:3] == (ta.PREFILL_TILE, 3, 16) for key in ta._probe_ok)
    k_cache, v_cache, meta = _paged_batch([(50, 50), (9, 1)], 16, 1, 16, seed=2)
    q = torch.randn(meta.num_tokens, 3, 16)
    # A BLAS where only one tiling passes: every sequence takes it, with the same bits.
    both = ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)
    for passing in (1, ta.PREFILL_TILE):
        monkeypatch.setattr(ta, "_probe", lambda qt, g, d, passing=passing: qt == passing)
        assert ta.tile_sizes(3, 16) == (passing, passing)
        assert torch.equal(_bits(ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)), _bits(both))
    # Where no tiling passes, the op runs the elementwise chunked attention for every call.
    monkeypatch.setattr(ta, "_probe", lambda qt, g, d: False)
    assert ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25) is None
    expected = chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(_bits(INV.attention(q, k_cache, v_cache, meta, 0.25)), _bits(expected))


def test_probe_detects_a_tiling_that_changes_bits(monkeypatch):
    real_bmm = torch.bmm

    def skewed(a, b, out=None):  # a BLAS whose many-row kernel rounds differently
        res = real_bmm(a, b)
        if a.shape[1] > 8:
            res = res * (1 + 2 ** -20)
        return res if out is None else out.copy_(res)

    monkeypatch.setattr(ta.torch, "bmm", skewed)
    monkeypatch.setattr(ta, "_probe_ok", {})
    assert ta.tile_sizes(3, 16) == (1, 1)
