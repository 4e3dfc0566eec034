"""The CPU deterministic path's fast paths keep bitwise row invariance.

- row_invariant_mm: whole 512-, 256-, 128-, 64- and 32-row BLAS calls (each used only where a probe found it
  bitwise equal to 16-row calls) and the 16-row fallback give every row the bits it gets alone.
- chunked_paged_attention: splitting the batch into pieces, zero padding of keys and chunks, and the
  sign of zero never change a token's bits.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.metadata import KV_CHUNK
from deepinfer.kernels.reference import attention as attn
from deepinfer.kernels.reference import matmul

from tests.engine.test_cpu_ops import _paged_batch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("wide_allowed", [(32, 64, 128, 256, 512), (128, 256, 512), (32, 512), (64,), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 96), (72, 40)])  # 72 * 2 bytes: bf16 chunks start misaligned
def test_row_invariant_mm_wide_and_narrow_calls_agree_with_rows_alone(monkeypatch, wide_allowed, dtype, k, n):
    real = matmul._wide_is_exact
    # As on a BLAS where some probes fail: those sizes are not used, the rest of the rows take 16-row calls.
    monkeypatch.setattr(matmul, "_wide_is_exact", lambda weight, aligned, size=128: (
        size in wide_allowed and real(weight, aligned, size)))
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(700, k, generator=gen).to(dtype)
    full = matmul.row_invariant_mm(x, w)
    for m in (1, 17, 32, 47, 64, 97, 128, 129, 256, 513, 650):
        part = matmul.row_invariant_mm(x[:m], w)
        assert torch.equal(_bits(part), _bits(full[:m])), f"{m} rows"
        assert torch.equal(_bits(matmul.row_invariant_mm(x[700 - m:], w)), _bits(full[700 - m:])), f"last {m}"
    for i in (0, 31, 32, 63, 64, 127, 128, 511, 512, 699):
        assert torch.equal(_bits(matmul.row_invariant_mm(x[i:i + 1], w)[0]), _bits(full[i]))
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), atol=0.1, rtol=2e-2)


def test_wide_probe_is_cached_per_weight_layout():
    w = torch.randn(40, 64)
    matmul.row_invariant_mm(torch.randn(130, 64), w)
    keys = [key for key in matmul._wide_ok if key[0] == (40, 64) and key[2] == torch.float32]
    assert keys, "a call with >= 128 rows probes the weight once"


def test_halving_sum_ignores_trailing_zero_padding():
    x = torch.randn(3, 5, 7)
    for width in (8, 16, 64):
        padded = torch.cat([x, torch.zeros(3, width - 5, 7)], dim=1)
        assert torch.equal(attn._halving_sum(padded, 1), attn._halving_sum(padded[:, :8], 1))


def test_pieces_cover_every_token_once_within_budget():
    positions = list(range(100)) + [5, 300, 7] + list(range(40))
    pieces = attn._pieces(positions, budget_pairs=1024)
    assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]] and pieces[-1][1] == len(positions)
    for a, b, chunks in pieces:
        assert chunks == max(positions[a:b]) // KV_CHUNK + 1
        assert (b - a) * chunks * KV_CHUNK <= 1024 or b - a == 1


def test_attention_bits_do_not_depend_on_how_the_batch_is_cut(monkeypatch):
    seqs = [(90, 90), (5, 1), (140, 1), (33, 17), (16, 16)]
    k_cache, v_cache, meta = _paged_batch(seqs, 16, 2, 16, seed=11)
    q = torch.randn(meta.num_tokens, 4, 16, generator=torch.Generator().manual_seed(3))
    whole = attn.chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    for elements in (1 << 12, 1 << 9, 1):  # down to one token per piece
        monkeypatch.setattr(attn, "_PIECE_ELEMENTS", elements)
        cut = attn.chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
        assert torch.equal(_bits(cut), _bits(whole)), f"pieces of {elements} elements"


def test_attention_output_zero_has_one_sign():
    # v == 0 everywhere except one negative value under a zero weight: sums of -0.0 and +0.0 must not
    # leave a token's output sign depending on padding from other tokens.
    k_cache, v_cache, meta = _paged_batch([(20, 20), (3, 1)], 16, 1, 16, seed=5)
    v_cache.zero_()
    v_cache.neg_()  # -0.0 everywhere
    q = torch.randn(meta.num_tokens, 1, 16)
    out = attn.chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert not torch.signbit(out).any()
