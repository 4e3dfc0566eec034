"""The CPU deterministic attention through torch's fused SDPA kernel (kernels/reference/sdpa_attention.py).

A token's bits must not depend on the other sequences of its batch, the batch size, where its prompt was
split into prefill chunks (a PREFILL_TILE tile or a one-token entry), padding, or what the slots past its
context hold; where a probe fails the fallback forms give the same bits; and the result is attention.
The specification both CPU attentions share (batch and prefill-split invariance, slots past the context,
bf16, the sign of zeros) is tests/engine/test_cpu_tiled_attention.py, parametrized over both; this file
adds what is particular to the SDPA form.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.kernels.reference import sdpa_attention as sa

from tests.engine.test_cpu_ops import _paged_batch
from tests.engine.test_cpu_tiled_attention import PLAIN_CASES, _Cache, _queries, plain_case
from tests.engine.test_cpu_tiled_attention import _run as run_attention

INV = make_ops("cpu", deterministic=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _run(cache: _Cache, qs: list[torch.Tensor], runs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    return run_attention(cache, qs, runs, sa.sdpa_paged_attention)


@pytest.mark.parametrize(("block_size", "heads"), PLAIN_CASES)
def test_the_ops_attention_is_the_sdpa_form(block_size, heads):
    q, k_cache, v_cache, meta, expected = plain_case(block_size, heads)
    got = INV.attention(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(_bits(got), _bits(sa.sdpa_paged_attention(q, k_cache, v_cache, meta, 0.25)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


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
