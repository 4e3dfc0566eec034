"""What the GEMM kernels share: the fp32 `tl.dot` chain over K (kernels/matmul.py's unsplit kernel,
kernels/matmul_split.py's split-K one, kernels/mla_proj.py's per-head projection), a split-K's ranges and
partial store and the grouped tile order (matmul.py's kernels and the TMA ones in kernels/matmul_tma.py; it
only decides which program computes a tile, never its bits).

Triton inlines a jit helper into its caller, so a kernel that calls it compiles to the code it had with the
loop written out in its body (the sm_90 PTX of every caller was compared before and after: the same
instructions); one copy keeps the chains that must agree bitwise (matmul's split and unsplit ones) the same
operations in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k_chain(acc, x_ptrs, w_ptrs, offs_k, K, k_first, k_last, stride_xk, stride_wk,
            EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus the fp32 `tl.dot` chain over k-tiles k_first .. k_last - 1, in increasing order; x_ptrs
    ([BLOCK_M, BLOCK_K] tiles) and w_ptrs ([BLOCK_K, BLOCK_N]) point at k-tile k_first and step BLOCK_K
    elements along K (strides stride_xk / stride_wk). EVEN_K: K is a multiple of BLOCK_K, no mask (else the
    K tail loads zeros). IEEE: full-precision fp32 dots (float32 inputs)."""
    for ki in range(k_first, k_last):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - ki * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


def split_ranges(k: int, block_k: int, splits: int) -> int:
    """k-tiles per range of a fixed-order split-K: a function of K, BLOCK_K and the split count only (never
    M), the last range taking what is left (possibly nothing); 0 for an unsplit chain (splits == 1, which
    the kernels never read)."""
    return triton.cdiv(triton.cdiv(k, block_k), splits) if splits > 1 else 0


@triton.jit
def store_partial(acc, part_ptr, split, offs_m, offs_n, M, N):
    """One range's fp32 chain of a fixed-order split-K into part[split] (part: [splits, M, N] float32,
    contiguous), the rows and columns inside [M, N] only: what the parallel forms' reduce sums."""
    base = part_ptr + split.to(tl.int64) * M.to(tl.int64) * N
    ptrs = base + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def sum_partials(part_ptr, offs, mask, split_stride, b_ptr, b_offs, SPLITS: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """((part[0] + part[1]) + part[2]) ... (+ bias) in float32 at flat offsets `offs` of one partial
    (part[s] starts `split_stride` elements after part[s - 1]); the bias at `b_offs`. The fixed order the
    parallel split-K's result is defined by: its reduce (kernels/matmul_split.py) and the RMSNorm that
    reads the partials itself (kernels/rmsnorm.py) both sum here, so both give the same bits."""
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * split_stride + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def grouped_tile_ids(tile, num_pid_m, tiles_per_group, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile `tile` in grouped order: GROUP_M row tiles sweep the same
    weight columns together, for L2 reuse. tiles_per_group = GROUP_M * (column tiles)."""
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@triton.jit
def rowwise_scaled(acc, as_ptr, bs_ptr, rows, cols, stride_bsn):
    """(acc * s_x) * s_w, the reference's order of the two scalings: what every rowwise FP8 epilogue
    applies first (one copy, so the plain and SWIGLU epilogues round the same values)."""
    sa = tl.load(as_ptr + rows)
    sb = tl.load(bs_ptr + cols * stride_bsn)
    return acc * sa[:, None] * sb[None, :]


@triton.jit
def rowwise_scaled_store(acc, as_ptr, bs_ptr, bias_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N,
                         stride_bsn, stride_om, HAS_BIAS: tl.constexpr):
    """The rowwise FP8 GEMMs' epilogue (pointer and TMA loads alike): `rowwise_scaled`, + bias, stored to
    the rows / columns inside [M, N]. rows / cols: offs_m / offs_n with the out-of-range ones read as 0
    (int64)."""
    acc = rowwise_scaled(acc, as_ptr, bs_ptr, rows, cols, stride_bsn)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_of(gate, up):
    """silu(gate) * up as kernels/activation.py rounds it (silu in fp32 rounded to the input dtype, the
    product rounded once), in the input dtype. The fused quantizers (`swiglu_values`) and the rowwise GEMM's
    SWIGLU epilogue share it, so every path computes the same bits."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def rowwise_swiglu_store(acc, as_ptr, bs_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N_OUT, stride_bsn,
                         stride_om, BLOCK_N: tl.constexpr):
    """The rowwise epilogue of a gate_up GEMM whose weight rows alternate gate j, up j (engine/models/quant/
    fp8_tensor.interleave_gate_up): each element rounded to the output dtype as `rowwise_scaled_store`
    stores it, then silu(gate) * up (`swiglu_of`) of each column pair (2j, 2j + 1), stored as column j of
    the [M, N_OUT] output. Bitwise the plain GEMM over [gate | up] rows, then kernels/activation.py."""
    y = rowwise_scaled(acc, as_ptr, bs_ptr, rows, cols, stride_bsn).to(out_ptr.dtype.element_ty)
    swiglu_pairs_store(y, out_ptr, offs_m, offs_n, M, N_OUT, stride_om, BLOCK_N)


@triton.jit
def swiglu_pairs_store(y, out_ptr, offs_m, offs_n, M, N_OUT, stride_om, BLOCK_N: tl.constexpr):
    """silu(gate) * up (`swiglu_of`) of each column pair (2j, 2j + 1) of a gate_up GEMM tile `y`, already
    rounded to the output dtype as the plain GEMM stores it, written as column j of the [M, N_OUT] output.
    The rowwise FP8 and the 16-bit batch-invariant GEMMs' SWIGLU epilogues both end here."""
    gate, up = tl.split(tl.reshape(y, (y.shape[0], BLOCK_N // 2, 2)))
    h = swiglu_of(gate, up)
    even, _ = tl.split(tl.reshape(offs_n, (BLOCK_N // 2, 2)))
    # Output columns n0 / 2 + j: telling the compiler they are contiguous from a multiple of BLOCK_N / 2
    # lets it store h in wide vectors (through shared memory) instead of one 2-byte store per element.
    offs_h = tl.max_contiguous(tl.multiple_of(even // 2, BLOCK_N // 2), BLOCK_N // 2)
    mask = (offs_m[:, None] < M) & (offs_h[None, :] < N_OUT)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_h[None, :], h, mask=mask)


@triton.jit
def linear_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                    SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr):
    """The batch-invariant 16-bit GEMMs' epilogue (kernels/matmul.py, kernels/matmul_tma.py): + bias in
    float32, rounded to the output dtype and stored to [M, N]; under SWIGLU (a gate_up weight whose rows
    alternate gate j, up j) those rounded elements go through `swiglu_pairs_store` into [M, N / 2] (unit
    column stride) instead: bitwise the plain GEMM over [gate | up] rows, then kernels/activation.py."""
    if HAS_BIAS:
        cols = tl.where(offs_n < N, offs_n, 0)
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if SWIGLU:
        swiglu_pairs_store(y, out_ptr, offs_m, offs_n, M, N // 2, stride_om, BLOCK_N)
    else:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def rowwise_epilogue(acc, as_ptr, bs_ptr, bias_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N, stride_bsn,
                     stride_om, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rowwise FP8 GEMMs' epilogue, pointer and TMA loads alike: `rowwise_swiglu_store` under SWIGLU
    (an [M, N / 2] output), else `rowwise_scaled_store`."""
    if SWIGLU:
        rowwise_swiglu_store(acc, as_ptr, bs_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N // 2, stride_bsn,
                             stride_om, BLOCK_N)
    else:
        rowwise_scaled_store(acc, as_ptr, bs_ptr, bias_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N,
                             stride_bsn, stride_om, HAS_BIAS)
