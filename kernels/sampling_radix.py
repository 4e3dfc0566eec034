"""Exact cutoff search over a row of scaled logits without sorting: the radix part of the filter kernel.

A row's tokens are ordered by (x descending, id ascending), x = logits / T as float32. Top-k and top-p
each keep a prefix of that order, so each is found as a cutoff: the key of its last token (the float32
value mapped to an order-preserving integer by `key_of`) plus how many tokens tied at that key it keeps.
`cutoff_search` narrows a key range with 16-bin histograms of counts (top-k) or int64 fixed-point masses
(top-p); once the range holds at most CAP tokens their keys are copied (in id order) to a per-row buffer
and the remaining passes read only that. Every sum is an integer sum and every other step a comparison,
so the cutoff does not depend on block sizes. kernels/sampling_filter.py uses it for rows whose kept set
is too large for its sorted buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl
from deepinfer.kernels.sampling import gumbel, masked_logits

try:  # as in kernels/sampling.py
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the installed Triton
    from triton.language.extra.cuda import libdevice


@triton.jit
def key_of(x):
    """Order-preserving map of float32 to int64 in [0, 2**32); -0.0 maps to +0.0's key (torch orders them
    as equal, so they must tie here too)."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    k = tl.where(b >= 0, b + 2**31, -1 - b)
    return tl.where(k == 2**31 - 1, 2**31, k)


@triton.jit
def value_of(k):
    """The float32 of a key (inverse of key_of)."""
    return tl.where(k >= 2**31, k - 2**31, -1 - k).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def exp32(x, LIBDEVICE: tl.constexpr):
    """float32 exp: libdevice's expf, the function torch's CUDA exp calls, so masses keep torch's bits."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def fixed_mass(x, top, scale, LIBDEVICE: tl.constexpr):
    """int64 trunc(exp(x - top) * 2**K): the torch path's fixed-point mass (float32 product, exact)."""
    return (exp32(x - top, LIBDEVICE) * scale).to(tl.int64)


@triton.jit
def scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK: tl.constexpr):
    """x = masked logits / T (IEEE division, as torch's); -inf out of range or masked."""
    return tl.math.div_rn(masked_logits(lrow, wrow, idx, ok, slot, HAS_MASK), temp)


@triton.jit
def _histogram(lrow, wrow, slot, temp, V, buf, n_buf, use_buf, lo, hi, shift, top, scale,
               HAS_MASK: tl.constexpr, HBLOCK: tl.constexpr, BINS: tl.constexpr, LIBDEVICE: tl.constexpr):
    # Per bin d of [lo, hi) (keys lo + d * 2**shift ...): the count and the int64 mass of its tokens, read
    # from the row or, once copied, from the buffer (a superset of the range).
    lane = tl.arange(0, HBLOCK)
    bins = tl.arange(0, BINS)
    cnt = tl.zeros([HBLOCK, BINS], tl.int32)
    mas = tl.zeros([HBLOCK, BINS], tl.int64)
    n = tl.where(use_buf != 0, n_buf, V)
    for off in range(0, n, HBLOCK):
        idx = off + lane
        ok = idx < n
        if use_buf != 0:
            key = tl.load(buf + idx, mask=ok, other=0)
            x = value_of(key)
        else:
            x = scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK)
            key = key_of(x)
        hit = (ok & (key >= lo) & (key < hi))[:, None] & (((key - lo) >> shift)[:, None] == bins[None, :])
        cnt += hit.to(tl.int32)
        mas += tl.where(hit, fixed_mass(x, top, scale, LIBDEVICE)[:, None], 0)
    return tl.sum(cnt, 0), tl.sum(mas, 0)


@triton.jit
def _copy_range(lrow, wrow, slot, temp, V, buf, lo, hi, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    # Writes the keys of the row's tokens in [lo, hi) to buf in id order; returns how many.
    lane = tl.arange(0, BLOCK)
    n = tl.zeros([], tl.int32)
    for off in range(0, V, BLOCK):
        idx = off + lane
        ok = idx < V
        key = key_of(scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK))
        inr = ok & (key >= lo) & (key < hi)
        f = inr.to(tl.int32)
        tl.store(buf + n + tl.cumsum(f, 0) - f, key, mask=inr)
        n += tl.sum(f, 0)
    tl.debug_barrier()   # the buffer is read next by other threads of this program
    return n


@triton.jit
def cutoff_search(lrow, wrow, slot, temp, V, buf, lo, n_in, target, top, scale, BY_MASS: tl.constexpr,
            HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr, BINS: tl.constexpr,
            CAP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The key of the target token among the tokens with key >= lo (n_in of them), in descending order:
    the target-th token (BY_MASS false; 1-based), or the first whose inclusive mass sum reaches target.
    Returns (key, count and mass of the tokens above that key, tokens at that key)."""
    bins = tl.arange(0, BINS)
    above = bins[None, :] > bins[:, None]          # [d, d']: bin d' lies above bin d
    hi = tl.full([], 2**32, tl.int64)
    above_c = tl.zeros([], tl.int64)
    above_m = tl.zeros([], tl.int64)
    n_buf = tl.zeros([], tl.int32)
    use_buf = tl.zeros([], tl.int32)
    while hi - lo > 1:
        if (use_buf == 0) & (n_in <= CAP):
            n_buf = _copy_range(lrow, wrow, slot, temp, V, buf, lo, hi, HAS_MASK, BLOCK)
            use_buf = 1
        shift = tl.zeros([], tl.int64)
        while ((hi - lo - 1) >> shift) >= BINS:
            shift += 1
        cnt, mas = _histogram(lrow, wrow, slot, temp, V, buf, n_buf, use_buf, lo, hi, shift, top, scale,
                              HAS_MASK, HBLOCK, BINS, LIBDEVICE)
        cnt = cnt.to(tl.int64)
        gt_c = tl.sum(tl.where(above, cnt[None, :], 0), 1)
        gt_m = tl.sum(tl.where(above, mas[None, :], 0), 1)
        if BY_MASS:
            r = target - above_m
            sel = (gt_m < r) & (r <= gt_m + mas)
        else:
            r = target - above_c
            sel = (gt_c < r) & (r <= gt_c + cnt)
        d = tl.max(tl.where(sel, bins, 0), 0).to(tl.int64)
        pick = bins == d
        above_c += tl.sum(tl.where(pick, gt_c, 0), 0)
        above_m += tl.sum(tl.where(pick, gt_m, 0), 0)
        n_in = tl.sum(tl.where(pick, cnt, 0), 0)
        lo = lo + (d << shift)
        hi = tl.minimum(hi, lo + (tl.full([], 1, tl.int64) << shift))
    return lo, above_c, above_m, n_in


@triton.jit
def radix_draw(lrow, wrow, slot, temp, V, buf, k, top_p, min_p, total_all, top, scale, key_r,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr, BINS: tl.constexpr,
                CAP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The token drawn for any row: the cutoffs by radix search, then one pass over the row that keeps every
    token with key > cut and the first `room` tokens (by id) at key == cut, and min-p's."""
    cut = tl.full([], -1, tl.int64)
    room = tl.zeros([], tl.int64)
    lo_p = tl.zeros([], tl.int64)
    n_p = tl.zeros([], tl.int64) + V
    total = total_all
    if k < V:
        cut, above_c, above_m, ties = cutoff_search(lrow, wrow, slot, temp, V, buf, lo_p, n_p, k, top, scale,
                                                    False, HAS_MASK, BLOCK, HBLOCK, BINS, CAP, LIBDEVICE)
        room = k - above_c
        total = above_m + room * fixed_mass(value_of(cut), top, scale, LIBDEVICE)
        lo_p = cut
        n_p = above_c + ties
    if top_p < 1.0:
        threshold = tl.math.ceil(total.to(tl.float64) * top_p).to(tl.int64)
        if threshold <= total:   # else the crossing lies past the top-k prefix: that prefix is kept
            cut_p, above_c, above_m, ties = cutoff_search(lrow, wrow, slot, temp, V, buf, lo_p, n_p,
                                                          threshold, top, scale, True, HAS_MASK, BLOCK,
                                                          HBLOCK, BINS, CAP, LIBDEVICE)
            each = fixed_mass(value_of(cut_p), top, scale, LIBDEVICE)   # > 0: the crossing token has mass
            room_p = (threshold - above_m + each - 1) // each
            shorter = (cut_p > cut) | ((cut_p == cut) & (room_p < room))
            room = tl.where(shorter, room_p, room)
            cut = tl.where(shorter, cut_p, cut)

    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = lane
    passed = tl.zeros([], tl.int64)   # tokens at key == cut before this block
    for off in range(0, V, BLOCK):
        idx = off + lane
        ok = idx < V
        x = scaled_logits(lrow, wrow, idx, ok, slot, temp, HAS_MASK)
        key = key_of(x)
        tie = (ok & (key == cut)).to(tl.int64)
        keep = ok & ((key > cut) | ((tie != 0) & (passed + tl.cumsum(tie, 0) - tie < room)))
        passed += tl.sum(tie, 0)
        keep = keep & (exp32(x - top, LIBDEVICE) >= min_p)   # always true for min_p = 0
        if tl.max(keep.to(tl.int32), 0) > 0:   # the noise (two float64 logs a token) only where needed
            score = tl.where(keep, x.to(tl.float64) + gumbel(key_r, idx, LIBDEVICE), float("-inf"))
            better = score > best   # a lane's ids only grow: the strict > keeps its lowest id on ties
            best_i = tl.where(better, idx, best_i)
            best = tl.where(better, score, best)
    b = tl.max(best, 0)
    return tl.min(tl.where(best == b, best_i, 2**31 - 1), 0)
