"""Sum over the last dimension, left to right, one term at a time, in one launch.

The deterministic MoE routers (kernels/reference/moe.py) need a row sum whose bits never depend on the
batch: `sum_last_in_order` writes it as E - 1 torch adds, one launch per term (63 per MoE layer on
DeepSeek-V2's 64 experts, more than half of a V2-Lite decode step's kernel launches). `row_sum_in_order`
is that same arithmetic in one kernel: each row's float32 terms added left to right (adds only, nothing
for the compiler to contract), so its bits equal the torch loop's, row-local whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor

_ROWS = 128


@triton.jit(do_not_specialize=["M"])
def _row_sum_kernel(x_ptr, out_ptr, M, N, stride_x, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < M
    row_ptr = x_ptr + rows.to(tl.int64) * stride_x
    total = tl.load(row_ptr, mask=ok, other=0.0)
    for j in range(1, N):
        total = total + tl.load(row_ptr + j, mask=ok, other=0.0)
    tl.store(out_ptr + rows, total, mask=ok)


def row_sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """float32 x [M, N] (N >= 1, unit stride along N) -> [M]: x[:, 0] + x[:, 1] + ... + x[:, N - 1] in that
    order, bitwise `sum_last_in_order(x)`."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,))
    m, n = x.shape
    if n < 1:
        raise ValueError(f"x: shape {tuple(x.shape)}: needs at least one column")
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _row_sum_kernel[(triton.cdiv(m, _ROWS),)](x, out, m, n, x.stride(0), ROWS=_ROWS, num_warps=4)
    return out
