"""Row quantization of short batches with each row's columns split over programs (decode-sized M).

`quantize_rows` and `silu_and_mul_quant` run one program per row: at M = 1 that is one program for the
whole row, at M = 256 256 programs of up to 16 warps (one or two per SM). Here a row's columns are cut into
chunks of BLOCK, one small program per (row, chunk), in two kernels:

1. `_chunk_amax_kernel`: each program computes its chunk's values (the row itself, or silu(gate) * up by
   `swiglu_values`, the function kernels/fp8_fused_quant.py uses) and writes the chunk's max |value| to a
   float32 workspace [M, chunks];
2. `_chunk_cast_kernel`: each program takes the max of its row's chunk maxima (the row max), the row scale
   (`row_scale`), recomputes its chunk's values and casts them (`e4m3_quotient`); the first chunk's
   program stores the scale.

The bits are the one-program kernels': a max is exact in any order and grouping, and every value is the
same elementwise computation (the same jitted helpers; the one product feeding an add, round_to_e4m3's
a * 512 + c, is exact, so FMA contraction cannot change it). tests/kernels/test_fp8_fused_quant_gpu.py
checks the bits on the device. The second pass re-reads the input, from L2 while it fits
(`SPLIT_MAX_BYTES`); larger inputs (prefill) keep the one-program kernels, which do not read twice. Which
path runs depends on M, the bits do not: batch invariance is kept.

Measured on the H200 (benchmarks/fp8_split_quant_timing.py, 2026-12-02, µs per call in CUDA graphs): the
fused SiLU-and-mul at I = 14,336 takes 3.0 / 5.6 / 11.9 µs at M = 1 / 64 / 256 against 6.7 / 7.2 / 13.3 for
the one-program kernel, so it is the default there; the plain row quantizer at K = 4,096 is slower split
(4.5 against 3.8 µs at M = 256), so `quantize_rows` uses this path only when asked (`split=N`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.fp8_row_quant import row_scale
from deepinfer.kernels.gemm_parts import swiglu_of

__all__ = ["split_quant", "use_split", "SPLIT_MAX_BYTES", "SPLIT_BLOCK"]

# Largest input (bytes) taking the split path: the second read must come from the 50 MB L2 of an H200.
SPLIT_MAX_BYTES = 24 << 20
# Columns per program: 8 values per thread at 4 warps (16-byte bf16 loads).
SPLIT_BLOCK = 1024


@triton.jit
def swiglu_values(x_rows, offs, mask, n_cols):
    """silu(gate) * up of the masked columns `offs`, as kernels/activation.py rounds it (silu in fp32
    rounded to the input dtype, the product rounded once), returned as fp32 holding the input dtype's
    values. kernels/fp8_fused_quant.py's one-program kernel uses this same function."""
    gate = tl.load(x_rows + offs, mask=mask, other=0.0)
    up = tl.load(x_rows + n_cols + offs, mask=mask, other=0.0)
    return swiglu_of(gate, up).to(tl.float32)


@triton.jit
def _chunk_values(x_ptr, row, offs, mask, stride_x, N_COLS, SWIGLU: tl.constexpr):
    x_row = x_ptr + row * stride_x
    if SWIGLU:
        y = swiglu_values(x_row, offs, mask, N_COLS)
    else:
        y = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit(do_not_specialize=["M"])
def _chunk_amax_kernel(x_ptr, amax_ptr, M, N_COLS, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                       SWIGLU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_COLS
    y = _chunk_values(x_ptr, row, offs, mask, stride_x, N_COLS, SWIGLU)
    tl.store(amax_ptr + row * CHUNKS + chunk, tl.max(tl.abs(y), axis=0))


@triton.jit(do_not_specialize=["M"])
def _chunk_cast_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, N_COLS, stride_x, stride_q, CHUNKS: tl.constexpr,
                       CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr, SWIGLU: tl.constexpr,
                       EPS: tl.constexpr, QMAX: tl.constexpr, HW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS_POW2)
    partial = tl.load(amax_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=0.0)   # |values| >= 0: 0 is neutral
    scale = row_scale(tl.max(partial, axis=0), EPS, QMAX)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_COLS
    y = _chunk_values(x_ptr, row, offs, mask, stride_x, N_COLS, SWIGLU)
    q = e4m3_quotient(y, scale, QMAX, HW)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    if chunk == 0:
        tl.store(s_ptr + row, scale)


def use_split(x: torch.Tensor, block: int | None = None) -> bool:
    """Whether `x` (the kernel's whole input) takes the split path: it fits `SPLIT_MAX_BYTES`, or the
    caller forces it with `block`."""
    return block is not None or x.numel() * x.element_size() <= SPLIT_MAX_BYTES


def split_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, n_cols: int, *, swiglu: bool,
                eps: float, qmax: float, block: int | None = None) -> None:
    """Fill q [M, n_cols] (e4m3) and s [M, 1] (float32) from x [M, n_cols] (or [M, 2 n_cols] = [gate | up]
    with `swiglu`) by the two split kernels; `block` (a power of two >= 16) overrides SPLIT_BLOCK."""
    m = x.shape[0]
    block = SPLIT_BLOCK if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block}: must be a power of two >= 16")
    block = min(block, max(16, triton.next_power_of_2(n_cols)))
    chunks = triton.cdiv(n_cols, block)
    amax = torch.empty((m, chunks), dtype=torch.float32, device=x.device)
    warps = max(1, min(4, block // 256))
    _chunk_amax_kernel[(m, chunks)](x, amax, m, n_cols, x.stride(0), CHUNKS=chunks, BLOCK=block,
                                    SWIGLU=swiglu, num_warps=warps)
    _chunk_cast_kernel[(m, chunks)](x, amax, q, s, m, n_cols, x.stride(0), q.stride(0), CHUNKS=chunks,
                                    CHUNKS_POW2=triton.next_power_of_2(chunks), BLOCK=block, SWIGLU=swiglu,
                                    EPS=eps, QMAX=qmax, HW=x.is_cuda, num_warps=warps)
