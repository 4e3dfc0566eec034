"""The faster forms of row_invariant_mm's 16-row calls (kernels/reference/matmul.py): W @ x^T, column slices.

Whatever form a weight's probe picks, a row's bits must be those of the plain torch.mm over its 16-row chunk
(the definition), whatever else shares the call; and a form that rounds differently must be rejected.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference import matmul


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition: each 16-row chunk (zero-padded) through torch.mm."""
    rows = -(-x.shape[0] // matmul.ROW_CHUNK) * matmul.ROW_CHUNK
    xp = x.new_zeros((rows, x.shape[1]))
    xp[:x.shape[0]] = x
    return torch.cat([torch.mm(xp[i:i + matmul.ROW_CHUNK], w.t()) for i in range(0, rows, 16)])[:x.shape[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [96, 4096, 4160])
def test_row_chunk_forms_give_the_plain_bits(dtype, n):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 64, generator=gen).to(dtype)
    x = torch.randn(21, 64, generator=gen).to(dtype)
    got = matmul.row_invariant_mm(x, w)
    assert torch.equal(_bits(got), _bits(_plain(x, w)))
    for r in (0, 5, 20):   # a row alone gives the same bits
        assert torch.equal(_bits(matmul.row_invariant_mm(x[r:r + 1], w)), _bits(got[r:r + 1]))
    key = next(k for k in matmul._forms if k[0] == (n, 64) and k[2] == dtype)
    form = matmul._forms[key]
    if form is not None and n > matmul.COL_CHUNK and n % 2 == 0:
        assert form.cols is None or all(b - a <= matmul.COL_CHUNK for a, b in form.cols)


def test_col_slices_cover_the_columns_in_aligned_equal_parts():
    assert matmul._col_slices(1536, 4) is None
    assert matmul._col_slices(3072, 4) == [(0, 1536), (1536, 3072)]
    parts = matmul._col_slices(49152, 4)
    assert parts[0] == (0, 2048) and parts[-1] == (47104, 49152) and len(parts) == 24
    assert matmul._col_slices(4100, 4) is None   # slices that would start misaligned: whole calls


@pytest.mark.parametrize("skew", ["transposed", "sliced", "both"])
def test_a_form_that_rounds_differently_is_rejected(monkeypatch, skew):
    real_mm = torch.mm
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 32, generator=gen)
    x = torch.randn(16, 32, generator=gen)
    want = _bits(_plain(x, w))

    def mm(a, b, out=None):   # a BLAS whose kernel for some operand shapes rounds differently
        res = real_mm(a, b)
        transposed = a.shape[0] != matmul.ROW_CHUNK
        sliced = max(a.shape[0], b.shape[1]) < w.shape[0]
        if (skew in ("transposed", "both") and transposed) or (skew in ("sliced", "both") and sliced):
            res = res * (1 + 2 ** -20)
        return res if out is None else out.copy_(res)

    monkeypatch.setattr(matmul, "_forms", {})
    monkeypatch.setattr(matmul.torch, "mm", mm)
    got = _bits(matmul.row_invariant_mm(x, w))
    form = next(iter(matmul._forms.values()))
    monkeypatch.undo()
    assert torch.equal(got, want)
    if skew == "transposed":
        assert form is not None and not form.transposed and form.cols is not None
    elif skew == "sliced":
        assert form is not None and form.transposed and form.cols is None
    else:
        assert form is None
