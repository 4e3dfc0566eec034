"""The CPU deterministic attention through torch's fused SDPA kernel (kernels/reference/sdpa_attention.py).

A token's bits must not depend on the other sequences of its batch, the batch size, where its prompt was
split into prefill chunks (a PREFILL_TILE tile or a one-token entry), padding, or what the slots past its
context hold; where a probe fails the fallback forms give the same bits; and the result is attention.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.kernels.reference import sdpa_attention as sa
from deepinfer.kernels.reference.attention import paged_attention_ref

from tests.engine.test_cpu_ops import _paged_batch
from tests.engine.test_cpu_tiled_attention import _Cache, _queries

INV = make_ops("cpu", deterministic=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _run(cache: _Cache, qs: list[torch.Tensor], runs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    meta = cache.meta(runs)
    q = torch.cat([qs[s][a:c] for s, a, c in runs])
    return list(sa.sdpa_paged_attention(q, cache.k, cache.v, meta, 0.125).split(meta.query_lens_cpu))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1), (9, 3)])
def test_sdpa_attention_matches_plain_attention(block_size, heads):
    seqs = [(70, 70), (5, 1), (140, 1), (33, 17), (16, 16), (90, 3)]
    k_cache, v_cache, meta = _paged_batch(seqs, block_size, heads[1], 16, seed=block_size + heads[0])
    q = torch.randn(meta.num_tokens, heads[0], 16, generator=torch.Generator().manual_seed(1))
    out = sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(_bits(INV.attention(q, k_cache, v_cache, meta, 0.25)), _bits(out)), "the ops' path"


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("split", [1, 31, 32, 45, 69])
def test_token_bits_independent_of_batch_and_prefill_split(batch, split):
    lengths = [70, 3, 150, 33, 64, 1, 97, 40][:batch]
    cache = _Cache(lengths, 16, 3, 16, seed=batch)
    qs = _queries(lengths, 9, 16)
    whole = _run(cache, qs, [(0, 0, lengths[0])])[0]                  # sequence 0 alone, one prefill
    others = [(s, (n - 1) if s % 2 else 0, n) for s, n in enumerate(lengths) if s]
    first = _run(cache, qs, [*others, (0, 0, split)])[-1]
    second = _run(cache, qs, [(0, split, lengths[0]), *others[::-1]])[0]
    assert torch.equal(_bits(torch.cat([first, second])), _bits(whole))
    for p in (0, split - 1, lengths[0] - 1):                           # as decode steps would see them
        alone = _run(cache, qs, [*others, (0, p, p + 1)])[-1]
        assert torch.equal(_bits(alone[0]), _bits(whole[p])), f"position {p}"


def test_decode_bits_independent_of_the_batch_at_two_threads():
    # Work items of a call land on other threads as the batch changes: the probes run per thread count.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lengths = [70, 300, 5, 129, 64, 65, 200, 33]
        cache = _Cache(lengths, 16, 3, 16, seed=11)
        qs = _queries(lengths, 9, 16)
        together = _run(cache, qs, [(s, n - 1, n) for s, n in enumerate(lengths)])
        for s, n in enumerate(lengths):
            assert torch.equal(_bits(_run(cache, qs, [(s, n - 1, n)])[0]), _bits(together[s])), f"seq {s}"
    finally:
        torch.set_num_threads(before)


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
    out = sa.sdpa_paged_attention(torch.randn(meta.num_tokens, 1, 16), k_cache, v_cache, meta, 0.25)
    assert not torch.signbit(out).any()


@pytest.mark.parametrize("passing", ["none", "one-token", "both"])
def test_probe_failures_fall_back_to_the_same_bits(monkeypatch, passing):
    k_cache, v_cache, meta = _paged_batch([(50, 50), (9, 1), (130, 1), (100, 40)], 16, 1, 16, seed=2)
    q = torch.randn(meta.num_tokens, 3, 16)
    both = sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert any(key[:5] == ("tile", 1, 3, 16, 1) for key in sa._probe_ok), "probes are cached"
    ok = {"none": (), "one-token": ("one",), "both": ("one", "tile")}[passing]
    monkeypatch.setattr(sa, "_probe", lambda kind, *args: kind in ok)
    plan = sa.plan_sdpa_attention(meta, 3, 1, 16, 16, q.device)
    assert all(c.batched == ("one" in ok or c.qt > 1) for c in plan.calls)
    assert any(c.qt > 1 for c in plan.calls) == ("tile" in ok)
    got = sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25, plan=plan)
    assert torch.equal(_bits(got), _bits(both))


def test_probe_detects_a_batched_call_that_changes_bits(monkeypatch):
    k_cache, v_cache, meta = _paged_batch([(50, 50), (9, 1), (70, 1)], 16, 1, 16, seed=2)
    q = torch.randn(meta.num_tokens, 3, 16)
    clean = sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25)
    real = sa._sdpa

    def skewed(a, k, v, mask, scale):  # a kernel whose calls of several entries round differently
        out = real(a, k, v, mask, scale)
        return out * (1 + 2 ** -20) if a.shape[0] > 1 else out

    monkeypatch.setattr(sa, "_sdpa", skewed)
    monkeypatch.setattr(sa, "_probe_ok", {})
    plan = sa.plan_sdpa_attention(meta, 3, 1, 16, 16, q.device)
    assert not any(c.batched for c in plan.calls if c.qt == 1)
    assert not any(c.qt > 1 for c in plan.calls)
    # The skewed batched calls are never used, so the bits are those of the canonical calls.
    got = sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25, plan=plan)
    assert torch.equal(_bits(got), _bits(clean))


def test_entries_take_eight_rows_where_the_four_row_form_fails(monkeypatch):
    real = sa._probe
    monkeypatch.setattr(sa, "_probe", lambda kind, blocks, g, d, h, rows: (
        not (kind == "one" and rows == 4) and real(kind, blocks, g, d, h, rows)))
    assert sa.entry_form(2, 3, 16, 3) == (8, True)
    lengths = [70, 129, 5, 100]
    cache = _Cache(lengths, 16, 3, 16, seed=12)
    qs = _queries(lengths, 9, 16)
    whole = _run(cache, qs, [(1, 0, lengths[1])])[0]
    together = _run(cache, qs, [(s, n - 1, n) for s, n in enumerate(lengths)])
    assert torch.equal(_bits(together[1][0]), _bits(whole[-1]))
    for s, n in enumerate(lengths):
        assert torch.equal(_bits(_run(cache, qs, [(s, n - 1, n)])[0]), _bits(together[s])), f"seq {s}"
