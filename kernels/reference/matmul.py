"""Plain-torch matmul: the float64 reference, and the CPU engine's row-invariant matmul.

`bi_linear_ref` is the reference the Triton kernel's tests compare against. `row_invariant_mm` is what
the CPU deterministic path runs: torch.mm on CPU is not row-invariant in general (the BLAS kernel it picks,
and so the order in which a row's products are summed, may depend on M), so a row's result is *defined*
as torch.mm over a chunk of exactly ROW_CHUNK rows: whatever else shares the call, a row gives those bits.

Big prefill batches would then pay a BLAS call (and a repack of the weight) per 16 rows, about twice the
time per row of one large call. So for each weight (shape, dtype, strides, thread count) the first call
with at least WIDE_CHUNK rows probes, on seeded random rows, whether one WIDE_CHUNK-row call gives bitwise
the same rows as its 16-row chunks; only where it does are whole WIDE_CHUNK-row calls used. A GEMM's
summation order depends on the shapes and the code path, never on the values, so if the orders differed
anywhere, random rows would show it in the low bits of some of the WIDE_CHUNK x N outputs; where the probe
fails (another BLAS, another CPU), every row takes the 16-row chunks and the result is the same by definition.
"""

from __future__ import annotations

import torch

ROW_CHUNK = 16
WIDE_CHUNK = 128
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


def _mm_chunks(xp: torch.Tensor, wt: torch.Tensor, start: int, stop: int, size: int, aligned: bool,
               out: list[torch.Tensor]) -> None:
    for i in range(start, stop, size):
        chunk = xp[i:i + size]
        out.append(torch.mm(chunk if aligned else chunk.clone(), wt))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls -0.0 == 0.0 and NaN != NaN)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _wide_is_exact(weight: torch.Tensor, aligned: bool) -> bool:
    """Whether a WIDE_CHUNK-row torch.mm gives bitwise the rows of its ROW_CHUNK-row calls (cached)."""
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, torch.get_num_threads(), aligned)
    ok = _wide_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(WIDE_CHUNK + weight.shape[1])
        probe = torch.randn(WIDE_CHUNK, weight.shape[1], generator=gen).to(weight.dtype)
        wt = weight.t()
        narrow: list[torch.Tensor] = []
        _mm_chunks(probe, wt, 0, WIDE_CHUNK, ROW_CHUNK, aligned, narrow)
        ok = _bits_equal(torch.mm(probe, wt), torch.cat(narrow))
        _wide_ok[key] = ok
    return ok


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
    wide_rows = padded_rows // WIDE_CHUNK * WIDE_CHUNK
    if wide_rows and not _wide_is_exact(weight, aligned):
        wide_rows = 0
    chunks: list[torch.Tensor] = []
    _mm_chunks(xp, wt, 0, wide_rows, WIDE_CHUNK, aligned, chunks)
    _mm_chunks(xp, wt, wide_rows, padded_rows, ROW_CHUNK, aligned, chunks)
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out[:rows]
