"""The parallel passes of the filter kernel: each row's max, its bands, and the copy of the kept band.

A filtered row (kernels/sampling_filter.py) is read by programs (row, chunk), CHUNK tokens each, so a
batch of one row still spreads over the GPU:
  1. `chunk_max_kernel`: each chunk's max of x = logits / T.
  2. `chunk_bands_kernel`: the row's max from the chunks' (exact), then per band j (tokens with
     x >= max - 0.5 * 2**(5j/7), j < 8: 0.5 ... 16 below the max) the chunk's count; for a top-p row
     without top-k also each band's int64 fixed-point mass and the chunk's total; with min-p the lowest x
     it keeps.
  3. `chunk_copy_kernel`: every program reduces the bands over the row's chunks and picks (`decide`) the
     narrowest band that holds every token the row can keep, if it holds at most SORT tokens; each chunk
     then copies its tokens of that band to the row's buffer, at the offset the earlier chunks' counts give.
Counts and masses are integer sums and max/min are exact, so every program of a row decides the same band
and the buffer does not depend on the chunking.
"""

from __future__ import annotations

import triton
import triton.language as tl
from deepinfer.kernels.pdl import wait_for_producers
from deepinfer.kernels.sampling_radix import exp32, fixed_mass, key_of, scaled_logits


@triton.jit
def filter_row(params_ptr, stride_params, f):
    """Filtered row f's (row, seed, position, k, T, top-p, min-p) from the packed parameters
    (kernels/reference/sampling.py's pack_filter_params)."""
    p = params_ptr + f
    temp = tl.load(p + 4 * stride_params).to(tl.int32).to(tl.float32, bitcast=True)
    top_p = tl.load(p + 5 * stride_params).to(tl.float64, bitcast=True)
    min_p = tl.load(p + 6 * stride_params).to(tl.int32).to(tl.float32, bitcast=True)
    return (tl.load(p), tl.load(p + stride_params), tl.load(p + 2 * stride_params),
            tl.load(p + 3 * stride_params), temp, top_p, min_p)


@triton.jit
def row_pointers(logits_ptr, bitmask_ptr, slots_ptr, row, stride_logits, stride_bitmask,
                 HAS_MASK: tl.constexpr):
    """(logits row, grammar-bitmask row, slot) of batch row `row` (slot -1: unconstrained or no mask)."""
    slot = -1
    if HAS_MASK:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    return logits_ptr + row * stride_logits, bitmask_ptr + slot * stride_bitmask, slot


@triton.jit
def row_top(part_max_ptr, f, NC, NCP: tl.constexpr):
    """The row's max x from its chunks' maxima, finite (0 for a row without one, as the torch path's
    _finite)."""
    c = tl.arange(0, NCP)
    top = tl.max(tl.load(part_max_ptr + f * NC + c, mask=c < NC, other=float("-inf")), 0)
    return tl.where(tl.abs(top) < float("inf"), top, 0.0)


@triton.jit
def band_thresholds(top, NB: tl.constexpr):
    """float32 [NB]: the bands' lower bounds, top - 0.5 * 2**(5j/7)."""
    return top - 0.5 * tl.exp2(tl.arange(0, NB).to(tl.float32) * (5.0 / 7.0))


@triton.jit
def decide(part_cnt_ptr, part_mas_ptr, part_tot_ptr, part_low_ptr, f, NC, V, k, top_p, min_p, thr,
           NCP: tl.constexpr, NB: tl.constexpr, SORT: tl.constexpr):
    """(band j, its token count, the row's total mass): j = NB when no band of at most SORT tokens holds
    every token the row can keep."""
    c = tl.arange(0, NCP)
    js = tl.arange(0, NB)
    ok = c < NC
    at = f * NC * NB + c[:, None] * NB + js[None, :]
    cnt = tl.sum(tl.load(part_cnt_ptr + at, mask=ok[:, None], other=0), 0).to(tl.int64)
    mas = tl.sum(tl.load(part_mas_ptr + at, mask=ok[:, None], other=0), 0)
    total = tl.sum(tl.load(part_tot_ptr + f * NC + c, mask=ok, other=0), 0)
    low = tl.min(tl.load(part_low_ptr + f * NC + c, mask=ok, other=float("inf")), 0)
    # (Row scalars are broadcast to [NB] first: Triton's interpreter cannot & a scalar with a tensor.)
    kb = tl.zeros([NB], tl.int64) + k
    pb = tl.zeros([NB], tl.float64) + top_p
    holds = (kb < V) & (cnt >= kb)   # the first k tokens: a prefix, so inside once the band counts k
    threshold = tl.math.ceil(total.to(tl.float64) * top_p).to(tl.int64)
    holds = holds | ((kb >= V) & (pb < 1.0) & (mas >= threshold))   # the top-p crossing is inside
    # Every token min-p keeps is inside (when top-k and top-p both cut, top-p's total needs the first k
    # tokens inside: the first condition).
    holds = holds | ((tl.zeros([NB], tl.float32) + min_p > 0.0) & (low >= thr) & ((kb >= V) | (pb >= 1.0)))
    j = tl.min(tl.where(holds & (cnt <= SORT), js, NB), 0)
    return j, tl.sum(tl.where(js == j, cnt, 0), 0), total


@triton.jit
def chunk_max_kernel(logits_ptr, params_ptr, bitmask_ptr, slots_ptr, part_max_ptr, V, NC, stride_params,
                      stride_logits, stride_bitmask, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    f = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row, _, _, _, temp, _, _ = filter_row(params_ptr, stride_params, f)
    lrow, wrow, slot = row_pointers(logits_ptr, bitmask_ptr, slots_ptr, row, stride_logits, stride_bitmask,
                                    HAS_MASK)
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = off + lane
        m = tl.maximum(m, scaled_logits(lrow, wrow, idx, idx < V, slot, temp, HAS_MASK))
    tl.store(part_max_ptr + f * NC + chunk, tl.max(m, 0))


@triton.jit
def chunk_bands_kernel(logits_ptr, params_ptr, bitmask_ptr, slots_ptr, part_max_ptr, part_cnt_ptr,
                        part_mas_ptr, part_tot_ptr, part_low_ptr, V, NC, stride_params, stride_logits,
                        stride_bitmask, scale, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
                        HBLOCK: tl.constexpr, NCP: tl.constexpr, NB: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr = 0):
    wait_for_producers(PDL)
    f = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row, _, _, k, temp, top_p, min_p = filter_row(params_ptr, stride_params, f)
    lrow, wrow, slot = row_pointers(logits_ptr, bitmask_ptr, slots_ptr, row, stride_logits, stride_bitmask,
                                    HAS_MASK)
    top = row_top(part_max_ptr, f, NC, NCP)
    thr = band_thresholds(top, NB)
    # Masses only where `decide` reads them (top-p without top-k), min-p's lowest x only with min-p: a
    # top-k row's pass is comparisons and counts.
    need_mass = (k >= V) & (top_p < 1.0)
    lane = tl.arange(0, HBLOCK)
    cnt = tl.zeros([HBLOCK, NB], tl.int32)
    mas = tl.zeros([HBLOCK, NB], tl.int64)
    tot = tl.zeros([HBLOCK], tl.int64)
    low = tl.full([HBLOCK], float("inf"), tl.float32)
    for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, HBLOCK):
        idx = off + lane
        ok = idx < V
        x = scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK)
        inb = ok[:, None] & (x[:, None] >= thr[None, :])
        cnt += inb.to(tl.int32)
        if need_mass:
            m = fixed_mass(x, top, scale, LIBDEVICE)   # 0 out of range (x = -inf)
            tot += m
            mas += tl.where(inb, m[:, None], 0)
        if min_p > 0.0:
            low = tl.minimum(low, tl.where(ok & (exp32(x - top, LIBDEVICE) >= min_p), x, float("inf")))
    js = tl.arange(0, NB)
    at = (f * NC + chunk) * NB + js
    tl.store(part_cnt_ptr + at, tl.sum(cnt, 0))
    tl.store(part_mas_ptr + at, tl.sum(mas, 0))
    tl.store(part_tot_ptr + f * NC + chunk, tl.sum(tot, 0))
    tl.store(part_low_ptr + f * NC + chunk, tl.min(low, 0))


@triton.jit
def chunk_copy_kernel(logits_ptr, params_ptr, bitmask_ptr, slots_ptr, part_max_ptr, part_cnt_ptr,
                       part_mas_ptr, part_tot_ptr, part_low_ptr, buf_ptr, buf_stride, V, NC, stride_params,
                       stride_logits, stride_bitmask, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK: tl.constexpr, NCP: tl.constexpr, NB: tl.constexpr, SORT: tl.constexpr,
                       PDL: tl.constexpr = 0):
    wait_for_producers(PDL)
    f = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row, _, _, k, temp, top_p, min_p = filter_row(params_ptr, stride_params, f)
    top = row_top(part_max_ptr, f, NC, NCP)
    thr = band_thresholds(top, NB)
    j, _, _ = decide(part_cnt_ptr, part_mas_ptr, part_tot_ptr, part_low_ptr, f, NC, V, k, top_p, min_p, thr,
                     NCP, NB, SORT)
    if j < NB:
        js = tl.arange(0, NB)
        t = tl.sum(tl.where(js == j, thr, 0.0), 0)
        c = tl.arange(0, NCP)
        n = tl.sum(tl.load(part_cnt_ptr + (f * NC + c) * NB + j, mask=c < chunk, other=0), 0)
        lrow, wrow, slot = row_pointers(logits_ptr, bitmask_ptr, slots_ptr, row, stride_logits,
                                        stride_bitmask, HAS_MASK)
        buf = buf_ptr + f * buf_stride
        lane = tl.arange(0, BLOCK)
        for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            idx = off + lane
            ok = idx < V
            x = scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK)
            inb = ok & (x >= t)
            g = inb.to(tl.int32)
            comp = (key_of(x) << 31) | (2**31 - 1 - idx).to(tl.int64)   # descending: (key desc, id asc)
            tl.store(buf + n + tl.cumsum(g, 0) - g, comp, mask=inb)
            n += tl.sum(g, 0)
