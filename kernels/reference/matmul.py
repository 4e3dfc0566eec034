"""Plain-torch matmul: the float64 reference, and the CPU engine's row-invariant matmul.

`bi_linear_ref` is the reference the Triton kernel's tests compare against. `row_invariant_mm` is what
the CPU deterministic path runs: torch.mm on CPU is not row-invariant in general (the BLAS kernel it picks,
and so the order in which a row's products are summed, may depend on M), so a row's result is *defined*
as torch.mm over a chunk of exactly ROW_CHUNK rows: whatever else shares the call, a row gives those bits.

Big prefill batches would then pay a BLAS call (and a repack of the weight) per 16 rows, about twice the
time per row of one large call, and decode batches of a few dozen rows would stream every weight once per 16
rows. So for each weight (shape, dtype, strides, thread count) and each size of WIDE_CHUNKS, the first call
with at least that many rows probes, on seeded random rows, whether one call of that many rows gives bitwise
the same rows as its 16-row chunks; rows are then covered by the largest sizes that passed (the rest by
16-row calls). A GEMM's summation order depends on the shapes and the code path, never on the values, so if
the orders differed anywhere, random rows would show it in the low bits of some of the size x N outputs;
where a probe fails (another BLAS, another CPU), that size is not used and the result is the same by
definition. Every call writes straight into one output (no concatenation).
ROW_CHUNK-row calls (decode steps below 32 rows, the rest of others) run in the fastest form whose probe
shows it gives the plain call's bits: out^T = W @ x^T (MKL: 10-35% faster at 16 rows for every decode shape
of a 135M model), and for wide weights (N > COL_CHUNK: lm head, merged gate/up) in equal column slices; each
output is the same dot over K, only the blocking around it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_CHUNK = 16
# Output columns per torch.mm of a ROW_CHUNK-row call on a wide weight (the lm head, merged gate/up): MKL
# runs such calls measurably faster in column slices of this width (written in place into the output) than
# whole. Used per weight only where its probe shows the slices give bitwise the whole call's columns.
COL_CHUNK = 2048
# Larger row calls, each used only where its probe passed (largest first). 32 and 64 are decode batches: one
# call streams each weight once where 16-row calls stream it per chunk (135M shape, 2 cores: a 64-row decode
# step's GEMMs 183 -> 138 ms, 32 rows 103 -> 95).
WIDE_CHUNKS = (512, 256, 128, 64, 32)
WIDE_CHUNK = WIDE_CHUNKS[-1]
# Allocator alignment of fresh CPU tensors; chunks that start elsewhere are copied so the BLAS kernel
# never sees a differently aligned operand for the same row.
ALIGN_BYTES = 64

_wide_ok: dict[tuple, bool] = {}


def bi_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference: float64 matmul (+ bias), rounded once to x's dtype (no TF32 involved)."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def _col_slices(n: int, elem: int) -> list[tuple[int, int]] | None:
    """Equal column slices of at most COL_CHUNK (aligned starts) for n output columns; None if one does."""
    parts = -(-n // COL_CHUNK)
    if parts < 2 or n % parts or (n // parts * elem) % ALIGN_BYTES:
        return None
    w = n // parts
    return [(a, a + w) for a in range(0, n, w)]


@dataclass(frozen=True)
class _Form:
    """How a ROW_CHUNK-row call runs: as out^T = W @ x^T (`transposed`), in column slices (`cols`)."""

    transposed: bool
    cols: list[tuple[int, int]] | None


_forms: dict[tuple, _Form | None] = {}


def _mm_chunks(xp: torch.Tensor, wt: torch.Tensor, start: int, stop: int, size: int, aligned: bool,
               out: torch.Tensor, form: _Form | None = None) -> None:
    """out[i:i+size] = xp[i:i+size] @ wt for i in range(start, stop, size) (out rows aligned or copied);
    `form`: the column slices / transposed product its probe showed gives the same bits."""
    direct = (out.shape[1] * out.element_size()) % ALIGN_BYTES == 0
    for i in range(start, stop, size):
        chunk = xp[i:i + size]
        chunk = chunk if aligned else chunk.clone()
        if direct and form is not None:
            for a, b in form.cols or [(0, out.shape[1])]:
                if form.transposed:   # [b - a, size], then into out's columns
                    out[i:i + size, a:b].copy_(torch.mm(wt[:, a:b].t(), chunk.t()).t())
                else:
                    torch.mm(chunk, wt[:, a:b], out=out[i:i + size, a:b])
        elif direct:
            torch.mm(chunk, wt, out=out[i:i + size])
        else:
            out[i:i + size] = torch.mm(chunk, wt)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls -0.0 == 0.0 and NaN != NaN)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _wide_is_exact(weight: torch.Tensor, aligned: bool, size: int = WIDE_CHUNK) -> bool:
    """Whether a `size`-row torch.mm gives bitwise the rows of its ROW_CHUNK-row calls (cached)."""
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, torch.get_num_threads(), aligned, size)
    ok = _wide_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(size + weight.shape[1])
        probe = torch.randn(size, weight.shape[1], generator=gen).to(weight.dtype)
        wt = weight.t()
        wide, narrow = (probe.new_empty((size, weight.shape[0])) for _ in range(2))
        _mm_chunks(probe, wt, 0, size, size, aligned, wide)
        _mm_chunks(probe, wt, 0, size, ROW_CHUNK, aligned, narrow)
        ok = _bits_equal(wide, narrow)
        _wide_ok[key] = ok
    return ok


def _row_chunk_form(weight: torch.Tensor, aligned: bool) -> _Form | None:
    """The fastest form of ROW_CHUNK-row calls on this weight that gives bitwise the plain calls' rows
    (probed on seeded random rows, cached like _wide_is_exact); None: plain torch.mm calls."""
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, torch.get_num_threads(), aligned,
           "form")
    if key in _forms:
        return _forms[key]
    cols = _col_slices(weight.shape[0], weight.element_size())
    # Fastest first (MKL, 16 rows): W @ x^T in column slices, W @ x^T whole, x @ W^T in column slices.
    candidates = [_Form(True, cols)] if cols else []
    candidates += [_Form(True, None)] + ([_Form(False, cols)] if cols else [])
    gen = torch.Generator().manual_seed(weight.shape[0] + weight.shape[1])
    probe = torch.randn(ROW_CHUNK, weight.shape[1], generator=gen).to(weight.dtype)
    plain = probe.new_empty((ROW_CHUNK, weight.shape[0]))
    _mm_chunks(probe, weight.t(), 0, ROW_CHUNK, ROW_CHUNK, aligned, plain)
    chosen = None
    for form in candidates:
        got = probe.new_empty((ROW_CHUNK, weight.shape[0]))
        _mm_chunks(probe, weight.t(), 0, ROW_CHUNK, ROW_CHUNK, aligned, got, form)
        if _bits_equal(got, plain):
            chosen = form
            break
    _forms[key] = chosen
    return chosen


def row_invariant_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T with row i's bits those of torch.mm over a ROW_CHUNK-row chunk."""
    rows, k = x.shape
    padded_rows = -(-rows // ROW_CHUNK) * ROW_CHUNK
    aligned = (k * x.element_size()) % ALIGN_BYTES == 0
    if padded_rows == rows and aligned and x.is_contiguous() and x.data_ptr() % ALIGN_BYTES == 0:
        xp = x  # every chunk already starts aligned: no padded copy needed
    else:
        xp = x.new_zeros((padded_rows, k))
        xp[:rows] = x
    wt = weight.t()
    out = x.new_empty((padded_rows, weight.shape[0]))
    done = 0
    for size in WIDE_CHUNKS:
        wide_rows = (padded_rows - done) // size * size
        if wide_rows and _wide_is_exact(weight, aligned, size):
            _mm_chunks(xp, wt, done, done + wide_rows, size, aligned, out)
            done += wide_rows
    if done < padded_rows:
        _mm_chunks(xp, wt, done, padded_rows, ROW_CHUNK, aligned, out, _row_chunk_form(weight, aligned))
    return out[:rows]
