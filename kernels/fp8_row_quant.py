"""Rowwise activation quantization for the rowwise FP8 GEMM: x [M, K] -> e4m3 rows + a float32 scale each.

A row's scale is max(max |x| of the row, EPS) / 448 and its values rtne(x / scale) clamped to +-448 on the
e4m3 grid: bitwise `quantize_act_ref(x, group=K)` (kernels/reference/fp8_matmul.py). The row max is exact
whatever the order it is taken in and everything else is elementwise, so the bits depend on neither the
chunking nor the rows sharing a program: batch-invariant by construction.

`quantize_rows` holds a whole row in registers when it fits (`RESIDENT_MAX` columns: 16 warps x 32 lanes x
64 fp32 values): one read of the row, the max, then the cast from registers. The previous kernel (four rows
per program, 1,024-column chunks, the row read twice) spent 11-12 us on a 14,336-column activation at
M <= 256 on the H200, one dependent load after another; the resident kernel issues all of a row's loads
at once. Longer rows take two passes (max, then cast) over 4,096-column chunks, the second read mostly
from L2. `row_scale` / `e4m3_quotient` (kernels/e4m3.py) are the two steps every quantizing kernel here shares
(kernels/fp8_fused_quant.py fuses them into RMSNorm and SiLU-and-mul). `split=N` runs
kernels/fp8_split_quant.py instead (a row's columns over several programs, the same bits); it is not the
default here: on the H200 it was slower than this kernel at K = 4,096 (M = 256: 4.5 against 3.8 us;
M = 2,048: 16.4 against 12.7 us; benchmarks/fp8_split_quant_timing.py, 2026-12-02).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.reference.fp8_matmul import ACT_EPS, FP8_DTYPE, FP8_MAX

__all__ = ["quantize_rows", "row_launch", "RESIDENT_MAX"]

# Widest row one program holds in registers (64 fp32 values per thread at 16 warps).
RESIDENT_MAX = 32768
# Chunk width of the two-pass path (rows longer than RESIDENT_MAX).
_CHUNK = 4096
# Elements one program covers at least (short rows: several rows per program, fewer programs).
_MIN_ELEMS = 2048


@triton.jit
def row_scale(amax, EPS: tl.constexpr, QMAX: tl.constexpr):
    """The row scale from the row's max |x|: `/` by the constant, as fp8_matmul's quantizer and torch's
    division by a scalar give it on the GPU (an IEEE division differed in the last bit on the H200)."""
    return tl.maximum(amax, EPS) / QMAX


@triton.jit(do_not_specialize=["M"])
def _row_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr, RESIDENT: tl.constexpr, EPS: tl.constexpr, QMAX: tl.constexpr,
                      HW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    offs = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * stride_xm
    q_rows = q_ptr + rows[:, None] * stride_qm
    if RESIDENT:   # BLOCK >= K: the whole row in registers, read once
        mask = row_ok[:, None] & (offs[None, :] < K)
        x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=1), EPS, QMAX)
        q = e4m3_quotient(x, scale[:, None], QMAX, HW)
        tl.store(q_rows + offs[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = row_ok[:, None] & (k0 + offs[None, :] < K)
            x = tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = row_scale(amax, EPS, QMAX)
        for k0 in range(0, K, BLOCK):
            mask = row_ok[:, None] & (k0 + offs[None, :] < K)
            x = tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            q = e4m3_quotient(x, scale[:, None], QMAX, HW)
            tl.store(q_rows + k0 + offs[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def row_launch(k: int, chunk: int | None = None) -> dict[str, int]:
    """Launch shape of a row-quantizing kernel over rows of `k` columns: ROWS rows per program, BLOCK
    columns per step, RESIDENT (the row held in registers, BLOCK >= k) and num_warps. `chunk` forces the
    two-pass path with chunks of that many columns (a power of two; tests and benchmarks)."""
    if chunk is not None:
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"chunk={chunk}: must be a power of two >= 16")
        return {"ROWS": 1, "BLOCK": chunk, "RESIDENT": False, "num_warps": max(1, min(8, chunk // 512))}
    block = triton.next_power_of_2(max(k, 1))
    if block > RESIDENT_MAX:
        return {"ROWS": 1, "BLOCK": _CHUNK, "RESIDENT": False, "num_warps": 8}
    rows = max(1, _MIN_ELEMS // block)
    # 16-64 fp32 values per thread: enough loads in flight per warp, registers to spare.
    return {"ROWS": rows, "BLOCK": block, "RESIDENT": True,
            "num_warps": max(1, min(16, rows * block // 1024))}


def quantize_rows(x: torch.Tensor, *, chunk: int | None = None, split: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]); bitwise `quantize_act_ref(x, group=K)`.
    `chunk`: force the two-pass path (see `row_launch`); `split=N` (N > 0) the column-split kernels of
    kernels/fp8_split_quant.py with N columns per program (None or 0: this module's kernel, the faster one
    measured); the bits depend on none."""
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k and chunk is None and split:
        from deepinfer.kernels.fp8_split_quant import split_quant  # it imports this module

        split_quant(x, q, s, k, swiglu=False, eps=ACT_EPS, qmax=FP8_MAX, block=split)
    elif m and k:
        cfg = row_launch(k, chunk)
        _row_quant_kernel[(triton.cdiv(m, cfg["ROWS"]),)](
            x, q, s, m, k, x.stride(0), q.stride(0), ROWS=cfg["ROWS"], BLOCK=cfg["BLOCK"],
            RESIDENT=cfg["RESIDENT"], EPS=ACT_EPS, QMAX=FP8_MAX, HW=x.is_cuda, num_warps=cfg["num_warps"])
    return q, s
