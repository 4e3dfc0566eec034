"""The CPU deterministic attention's GEMM tiles (kernels/reference/tiled_attention.py).

A token's bits must not depend on the other sequences of its batch, the batch size, where its prompt was
split into prefill chunks (so whether it sits in a 32-token tile or alone in a one-token tile), or padding
rows, keys and matrices; and the result must be attention (checked against the plain reference).
"""

from __future__ import annotations

import functools

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference import tiled_attention as ta
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.reference.pointwise import fixed_path
from deepinfer.kernels.reference.sdpa_attention import sdpa_paged_attention

from tests.engine.test_cpu_ops import _paged_batch


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


# The CPU deterministic attentions that must meet the same specification (the tests parametrized by
# `attend`); tests/engine/test_cpu_sdpa_attention.py adds what is particular to the SDPA form.
ATTENTIONS = {"tiled": ta.tiled_paged_attention, "sdpa": sdpa_paged_attention}


def _run(cache: _Cache, qs: list[torch.Tensor], runs: list[tuple[int, int, int]],
         attend=ta.tiled_paged_attention) -> list[torch.Tensor]:
    meta = cache.meta(runs)
    q = torch.cat([qs[s][a:c] for s, a, c in runs])
    out = attend(q, cache.k, cache.v, meta, 0.125)
    assert out is not None, "the probes rejected the tiling on this machine"
    return list(out.split(meta.query_lens_cpu))


# Mixed prefill / decode steps over paged caches, per (block size, (q heads, kv heads)): against plain
# attention.
PLAIN_CASES = [(b, h) for h in [(4, 2), (4, 4), (6, 1), (9, 3)] for b in [16, 32]]


def plain_case(block_size: int, heads: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, meta, expected): one such step and its plain attention (scale 0.25)."""
    seqs = [(70, 70), (5, 1), (140, 1), (33, 17), (16, 16), (90, 3)]
    k_cache, v_cache, meta = _paged_batch(seqs, block_size, heads[1], 16, seed=block_size + heads[0])
    q = torch.randn(meta.num_tokens, heads[0], 16, generator=torch.Generator().manual_seed(1))
    return q, k_cache, v_cache, meta, paged_attention_ref(q, k_cache, v_cache, meta, 0.25)


@pytest.mark.parametrize("attend", ATTENTIONS.values(), ids=ATTENTIONS.keys())
@pytest.mark.parametrize(("block_size", "heads"), PLAIN_CASES)
def test_attention_matches_plain_attention(block_size, heads, attend):
    q, k_cache, v_cache, meta, expected = plain_case(block_size, heads)
    torch.testing.assert_close(attend(q, k_cache, v_cache, meta, 0.25), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attend", ATTENTIONS.values(), ids=ATTENTIONS.keys())
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("split", [1, 31, 32, 45, 69])
def test_token_bits_independent_of_batch_and_prefill_split(batch, split, attend):
    lengths = [70, 3, 150, 33, 64, 1, 97, 40][:batch]
    cache = _Cache(lengths, 16, 3, 16, seed=batch)
    qs = _queries(lengths, 9, 16)
    run = functools.partial(_run, attend=attend)
    whole = run(cache, qs, [(0, 0, lengths[0])])[0]                   # sequence 0 alone, one prefill
    # The same prompt split into two steps, each beside other sequences' prefills and decodes.
    others = [(s, (n - 1) if s % 2 else 0, n) for s, n in enumerate(lengths) if s]
    first = run(cache, qs, [*others, (0, 0, split)])[-1]
    second = run(cache, qs, [(0, split, lengths[0]), *others[::-1]])[0]
    assert torch.equal(_bits(torch.cat([first, second])), _bits(whole))
    # Token by token (every token alone in a one-token tile), as decode steps would see them.
    for p in (0, split - 1, lengths[0] - 1):
        alone = run(cache, qs, [*others, (0, p, p + 1)])[-1]
        assert torch.equal(_bits(alone[0]), _bits(whole[p])), f"position {p}"


@pytest.mark.parametrize("attend", ATTENTIONS.values(), ids=ATTENTIONS.keys())
def test_nan_in_slots_past_the_context_does_not_leak(attend):
    cache = _Cache([40, 20], 16, 2, 16, seed=3)
    qs = _queries([40, 20], 4, 16)
    clean = _run(cache, qs, [(0, 0, 40), (1, 19, 20)], attend)
    for table, n in zip(cache.tables, (40, 20)):  # poison every slot past each context
        for i, blk in enumerate(table):
            lo = max(0, n - i * 16)
            if lo < 16:
                cache.k[blk, lo:], cache.v[blk, lo:] = float("nan"), float("nan")
    poisoned = _run(cache, qs, [(0, 0, 40), (1, 19, 20)], attend)
    for a, b in zip(clean, poisoned):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("attend", ATTENTIONS.values(), ids=ATTENTIONS.keys())
def test_bfloat16_cache_matches_plain_attention_and_is_split_invariant(attend):
    cache = _Cache([50, 9], 16, 1, 16, seed=4)
    cache.k, cache.v = cache.k.bfloat16(), cache.v.bfloat16()
    qs = [q.bfloat16() for q in _queries([50, 9], 3, 16)]
    whole = _run(cache, qs, [(0, 0, 50), (1, 8, 9)], attend)
    meta = cache.meta([(0, 0, 50), (1, 8, 9)])
    expected = paged_attention_ref(torch.cat([qs[0], qs[1][8:]]), cache.k, cache.v, meta, 0.125)
    torch.testing.assert_close(torch.cat(whole).float(), expected.float(), atol=2e-2, rtol=2e-2)
    alone = _run(cache, qs, [(0, 49, 50)], attend)[0]
    assert torch.equal(_bits(alone[0]), _bits(whole[0][49]))


@pytest.mark.parametrize("attend", ATTENTIONS.values(), ids=ATTENTIONS.keys())
def test_zero_output_has_one_sign(attend):
    k_cache, v_cache, meta = _paged_batch([(20, 20), (3, 1)], 16, 1, 16, seed=5)
    v_cache.zero_()
    v_cache.neg_()  # -0.0 everywhere
    out = attend(torch.randn(meta.num_tokens, 1, 16), k_cache, v_cache, meta, 0.25)
    assert not torch.signbit(out).any()


@pytest.mark.parametrize("passing", ["none", "one-token", "both"])
def test_probe_failures_fall_back_to_the_same_bits(monkeypatch, passing):
    k_cache, v_cache, meta = _paged_batch([(50, 50), (9, 1), (130, 1), (100, 40)], 16, 1, 16, seed=2)
    q = torch.randn(meta.num_tokens, 3, 16)
    both = ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert any(key[:4] == (ta.PREFILL_TILE, 1, 3, 16) for key in ta._probe_ok), "probes are cached"
    # A BLAS where some tilings fail their probe: those tokens take one-token tiles or the canonical
    # torch.mm calls one by one, with the same bits.
    ok = {"none": (), "one-token": (1,), "both": (1, ta.PREFILL_TILE)}[passing]
    monkeypatch.setattr(ta, "_probe", lambda qt, blocks, g, d, call_blocks=None: qt in ok)
    expected = ((ta.UNITS[1] if 1 in ok else None), (ta.PREFILL_TILE if len(ok) == 2 else 1))
    assert ta.tile_sizes(3, 16) == expected
    got = ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(_bits(got), _bits(both))


def test_probe_detects_a_tiling_that_changes_bits(monkeypatch):
    real_bmm = torch.bmm
    k_cache, v_cache, meta = _paged_batch([(50, 50), (9, 1)], 16, 1, 16, seed=2)
    q = torch.randn(meta.num_tokens, 3, 16)
    clean = ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)

    def skewed(rows):  # a BLAS whose kernel for more than `rows` rows rounds differently
        def bmm(a, b, out=None):
            res = real_bmm(a, b)
            if a.shape[1] > rows:
                res = res * (1 + 2 ** -20)
            return res if out is None else out.copy_(res)
        return bmm

    for rows, sizes in ((8, (ta.UNITS[1], 1)), (0, (None, 1))):
        monkeypatch.setattr(ta.torch, "bmm", skewed(rows))
        monkeypatch.setattr(ta, "_probe_ok", {})
        assert ta.tile_sizes(3, 16) == sizes
        # The skewed calls are never used, so the bits are those of the canonical calls.
        assert torch.equal(_bits(ta.tiled_paged_attention(q, k_cache, v_cache, meta, 0.25)), _bits(clean))


@pytest.mark.parametrize("wider_ok", [True, False])
def test_decode_token_bits_do_not_depend_on_the_widest_neighbour(monkeypatch, wider_ok):
    # One-token tiles run in one call group over the widest span of the step where the probe for
    # (own span, call span) passes, and in calls of their own span where it fails: the same bits.
    if not wider_ok:
        real = ta._probe
        monkeypatch.setattr(ta, "_probe", lambda qt, blocks, g, d, call_blocks=None: (
            (call_blocks or blocks) == blocks and real(qt, blocks, g, d)))
    lengths = [70, 300, 5, 129]
    cache = _Cache(lengths, 16, 3, 16, seed=9)
    qs = _queries(lengths, 9, 16)
    for s, n in enumerate(lengths):
        alone = _run(cache, qs, [(s, n - 1, n)])[0]
        others = [(o, m - 1, m) for o, m in enumerate(lengths) if o != s]
        together = _run(cache, qs, [*others[:1], (s, n - 1, n), *others[1:]])[1]
        assert torch.equal(_bits(alone), _bits(together)), f"sequence {s}"


def test_exp_in_place_matches_fixed_path():
    x = torch.randn(3, 4, 64 * 70) * 30 - 10
    assert torch.equal(_bits(ta._exp_(x.clone())), _bits(fixed_path(torch.exp, x)))


def test_step_plan_is_reused_and_rebuilt_when_the_metadata_changes():
    ops = make_ops("cpu", deterministic=True)
    cache = _Cache([40, 90], 16, 1, 16, seed=6)
    qs = _queries([40, 90], 3, 16)
    meta = cache.meta([(0, 39, 40), (1, 89, 90)])
    q = torch.cat([qs[0][39:40], qs[1][89:90]])
    first = ops.attention(q, cache.k, cache.v, meta, 0.125)
    plan = ops._plan
    assert torch.equal(_bits(ops.attention(q, cache.k, cache.v, meta, 0.125)), _bits(first))
    assert ops._plan is plan, "the layers of one step share one plan"
    # The same metadata object updated in place (as a runner reusing buffers would): a new plan.
    other = cache.meta([(0, 20, 21), (1, 60, 61)])
    meta.positions.copy_(other.positions)
    meta.seq_lens.copy_(other.seq_lens)
    meta.slot_mapping.copy_(other.slot_mapping)
    q2 = torch.cat([qs[0][20:21], qs[1][60:61]])
    got = ops.attention(q2, cache.k, cache.v, meta, 0.125)
    assert ops._plan is not plan
    assert torch.equal(_bits(got), _bits(sdpa_paged_attention(q2, cache.k, cache.v, other, 0.125)))
