"""Sampling of the rows that narrow their distribution (top-k, top-p, min-p): exact, without a full sort.

`sample_filtered(...)` gives the torch sampler's draw (engine/sample/sampler.py, `Sampler._draw`) bit for
bit: with x = logits / T (float32, IEEE division) and each row's kept set = the first k tokens in
(x descending, id ascending) order, cut further to the shortest prefix of that order whose fixed-point
softmax mass reaches ceil(total * top_p), and intersected with {exp(x - max) >= min_p}, the token is the
argmax over the kept set of float64(x) + Gumbel noise keyed by (seed, position, token).

Every kept set is inside a prefix of that order: the tokens with x >= t for a threshold t. Three passes of
programs (row, chunk) find, per row, the narrowest of eight bands below the row's max that holds every
token it can keep and copy that band to a buffer (kernels/sampling_bands.py); one program per row then
sorts the buffer in registers and filters it exactly as the torch path filters the sorted row. A row whose
kept set may exceed SORT tokens (a broad distribution under a loose top-p, say) takes the radix search
instead (kernels/sampling_radix.py): exact too, one program per row, several passes over the row.

Every sum is an integer sum (counts, int64 fixed-point masses as in the torch path) and every other step a
comparison or an exact max/min, so the result does not depend on chunk or block sizes or on which other
rows are in the batch. `benchmarks/bench_sampling.py` times it against the torch path. Rows must have
T > 0 and at least one finite logit; a NaN logit gives an unspecified token (the torch path's sort and
this kernel's order treat NaN differently).

Imported only from the CUDA path (or under TRITON_INTERPRET=1): it imports Triton at module level.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from deepinfer.kernels.pdl import pdl_options, wait_for_producers
from deepinfer.kernels.reference.sampling import check_sampling_args
from deepinfer.kernels.sampling import gumbel, row_key
from deepinfer.kernels.sampling_bands import (
    band_thresholds,
    chunk_bands_kernel,
    chunk_copy_kernel,
    chunk_max_kernel,
    decide,
    filter_row,
    row_pointers,
    row_top,
)
from deepinfer.kernels.sampling_radix import exp32, fixed_mass, radix_draw, value_of

_CHUNK = 8192    # tokens per program of the max, band and copy passes
_BLOCK = 1024    # tokens per iteration of the max, copy and draw passes
_HBLOCK = 256    # tokens per iteration of a band or histogram pass (accumulators [_HBLOCK, 8 or 16])
_SORT = 2048     # tokens the sorted path holds in registers
_SMALL_SORT = 256   # ... and the smaller network it uses when a row's band holds no more
_NB = 8          # bands
_CAP = 4096      # keys the radix search's buffer holds
_BINS = 16       # radix bins
_NUM_WARPS = 8


@triton.jit
def _sorted_draw(buf, n, V, k, top_p, min_p, total_all, top, scale, key_r, SORT: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    # The draw from the n buffered tokens, a prefix of the row's order holding every token it can keep:
    # sorted by (x desc, id asc), then filtered as the torch path filters the sorted row.
    pos = tl.arange(0, SORT)
    comp = tl.sort(tl.load(buf + pos, mask=pos < n, other=-1), descending=True)   # empty slots last
    ids = (2**31 - 1 - (comp & (2**31 - 1))).to(tl.int32)
    x = value_of(comp >> 31)
    mass = tl.where(comp >= 0, fixed_mass(x, top, scale, LIBDEVICE), 0)
    keep = (comp >= 0) & (pos < k)
    if top_p < 1.0:
        total = tl.where(k < V, tl.sum(tl.where(pos < k, mass, 0), 0), total_all)
        threshold = tl.math.ceil(total.to(tl.float64) * top_p).to(tl.int64)
        keep = keep & (tl.cumsum(mass, 0) - mass < threshold)
    keep = keep & (exp32(x - top, LIBDEVICE) >= min_p)
    score = tl.where(keep, x.to(tl.float64) + gumbel(key_r, ids, LIBDEVICE), float("-inf"))
    best = tl.max(score, 0)
    return tl.min(tl.where(score == best, ids, 2**31 - 1), 0)


@triton.jit
def _filter_draw_kernel(
    logits_ptr, params_ptr, bitmask_ptr, slots_ptr, part_max_ptr, part_cnt_ptr, part_mas_ptr, part_tot_ptr,
    part_low_ptr, buf_ptr, buf_stride, out_ptr, V, NC, stride_params, stride_logits, stride_bitmask, scale,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr, BINS: tl.constexpr,
    CAP: tl.constexpr, SORT: tl.constexpr, SMALL_SORT: tl.constexpr, NB: tl.constexpr, NCP: tl.constexpr,
    LIBDEVICE: tl.constexpr, PDL: tl.constexpr = 0,
):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    f = tl.program_id(0).to(tl.int64)
    row, seed, pos, k, temp, top_p, min_p = filter_row(params_ptr, stride_params, f)
    top = row_top(part_max_ptr, f, NC, NCP)
    j, n, total_all = decide(part_cnt_ptr, part_mas_ptr, part_tot_ptr, part_low_ptr, f, NC, V, k, top_p,
                             min_p, band_thresholds(top, NB), NCP, NB, SORT)
    key_r = row_key(seed, pos)
    buf = buf_ptr + f * buf_stride
    if (j < NB) & (n <= SMALL_SORT):   # most rows: a sorting network a fraction of SORT's size
        token = _sorted_draw(buf, n, V, k, top_p, min_p, total_all, top, scale, key_r, SMALL_SORT, LIBDEVICE)
    elif j < NB:
        token = _sorted_draw(buf, n, V, k, top_p, min_p, total_all, top, scale, key_r, SORT, LIBDEVICE)
    else:
        lrow, wrow, slot = row_pointers(logits_ptr, bitmask_ptr, slots_ptr, row, stride_logits,
                                        stride_bitmask, HAS_MASK)
        token = radix_draw(lrow, wrow, slot, temp, V, buf, k, top_p, min_p, total_all, top, scale, key_r,
                           HAS_MASK, BLOCK, HBLOCK, BINS, CAP, LIBDEVICE)
    tl.store(out_ptr + f, token.to(tl.int64))


@triton.jit
def _mass_kernel(x_ptr, top_ptr, out_ptr, V, scale, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * V + idx, mask=idx < V, other=0.0)
    tl.store(out_ptr + row * V + idx, fixed_mass(x, tl.load(top_ptr + row), scale, LIBDEVICE), mask=idx < V)


def fixed_point_masses(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """int64 [S, V]: the masses the kernel computes for contiguous float32 rows x [S, V] with their finite
    float32 maxima top [S] (for tests against the torch path's `_fixed_point_mass`, bit for bit)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: expected contiguous float32 [S, V], got {x.dtype} {tuple(x.shape)}")
    if top.dtype != torch.float32 or tuple(top.shape) != (x.shape[0],) or top.device != x.device:
        raise ValueError(f"top: expected float32 [{x.shape[0]}] on {x.device}, got {top.dtype} "
                         f"{tuple(top.shape)} on {top.device}")
    out = torch.empty(x.shape, dtype=torch.int64, device=x.device)
    s, v = x.shape
    if out.numel():
        _mass_kernel[(s, triton.cdiv(v, _BLOCK))](x, top.contiguous(), out, v, fixed_point_scale(v),
                                                   BLOCK=_BLOCK, LIBDEVICE=not _interpreted())
    return out


def _interpreted() -> bool:
    return type(_filter_draw_kernel).__name__ == "InterpretedFunction"


def fixed_point_scale(vocab: int) -> float:
    """2**K of the torch path's fixed-point masses (sampler.fixed_point_bits: V masses stay below 2**62)."""
    return float(2 ** (62 - (vocab - 1).bit_length()))


def sample_filtered(logits: torch.Tensor, filter_params: torch.Tensor, bitmask: torch.Tensor | None = None,
                    bitmask_slots: torch.Tensor | None = None, *, chunk: int | None = None,
                    hblock: int | None = None, cap: int | None = None, sort: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """int64 [F]: the token drawn for each filtered row f (logits row filter_params[0, f]); see the module
    docstring.

    logits: float32/bf16/fp16 [S, V], last dim contiguous. filter_params: int64 [7, F] on the logits'
    device (kernels/reference/sampling.py's pack_filter_params: rows, seeds, positions, top-k, T > 0,
    top-p, min-p). bitmask int32 [slots, >= ceil(V/32)] with bitmask_slots int [S] (-1 = unconstrained),
    or None. `chunk` (tokens per program of the parallel passes, a multiple of 1024), `hblock` (tokens per
    band or histogram iteration, a power of two), `cap` (the radix search's buffer), `sort` (tokens the
    sorted path holds, a power of two; 1 sends every row to the radix search) and `num_warps` change only
    the speed, never the ids.
    """
    check_sampling_args(logits, None, bitmask, bitmask_slots)
    v = logits.shape[1]
    p = filter_params
    if p.dtype != torch.int64 or p.dim() != 2 or p.shape[0] != 7 or p.device != logits.device:
        raise ValueError(f"filter_params: expected int64 [7, F] on {logits.device} (pack_filter_params), got "
                         f"{p.dtype} {tuple(p.shape)} on {p.device}")
    if p.shape[1] > 1 and p.stride(1) != 1:
        raise ValueError("filter_params: last dimension must be contiguous")
    n = p.shape[1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if v > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: last dimension must be contiguous, got strides {tuple(logits.stride())}")
    if v >= 2**31 - 2 * _BLOCK:
        raise ValueError(f"logits: vocabulary of {v} tokens; token ids must stay well inside int32")
    hb = _HBLOCK if hblock is None else hblock
    cp = _CAP if cap is None else cap
    so = _SORT if sort is None else sort
    ch = _CHUNK if chunk is None else chunk
    if ch < _BLOCK or ch % _BLOCK:
        raise ValueError(f"chunk={ch}: must be a positive multiple of {_BLOCK}")
    if hb < 16 or hb & (hb - 1) or cp < 1 or so < 1 or so & (so - 1):
        raise ValueError(f"hblock={hb} must be a power of two >= 16, cap={cp} positive and sort={so} a "
                         "power of two")
    nc = triton.cdiv(v, ch)
    parts, buf = _workspace(n, nc, max(cp, so), logits.device)
    mask_t = bitmask if bitmask is not None else p    # any pointer; unused without HAS_MASK
    slots_t = bitmask_slots if bitmask_slots is not None else p
    common = dict(HAS_MASK=bitmask is not None, num_warps=num_warps or _NUM_WARPS,
                  **pdl_options(logits.device))
    ncp = triton.next_power_of_2(nc)
    strides = (p.stride(0), logits.stride(0), mask_t.stride(0))
    scale = fixed_point_scale(v)
    interp = _interpreted()
    chunk_max_kernel[(n, nc)](logits, p, mask_t, slots_t, parts[0], v, nc, *strides, CHUNK=ch, BLOCK=_BLOCK,
                               **common)
    chunk_bands_kernel[(n, nc)](logits, p, mask_t, slots_t, *parts, v, nc, *strides, scale, CHUNK=ch,
                                 HBLOCK=hb, NCP=ncp, NB=_NB, LIBDEVICE=not interp, **common)
    chunk_copy_kernel[(n, nc)](logits, p, mask_t, slots_t, *parts, buf, buf.stride(0), v, nc, *strides,
                                CHUNK=ch, BLOCK=_BLOCK, NCP=ncp, NB=_NB, SORT=so, **common)
    _filter_draw_kernel[(n,)](logits, p, mask_t, slots_t, *parts, buf, buf.stride(0), out, v, nc, *strides,
                              scale, BLOCK=_BLOCK, HBLOCK=hb, BINS=_BINS, CAP=cp, SORT=so,
                              SMALL_SORT=min(so, _SMALL_SORT), NB=_NB, NCP=ncp,
                              LIBDEVICE=not interp, **common)
    return out


def _workspace(n: int, nc: int, buf_len: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...],
                                                                            torch.Tensor]:
    """The passes' scratch in one allocation: per (row, chunk) the max (float32), the band counts (int32
    [NB]) and masses (int64 [NB]), the total mass (int64) and min-p's lowest x (float32); the row buffers."""
    per_chunk = n * nc
    ws = torch.empty(per_chunk * (2 * _NB + 3) + n * buf_len, dtype=torch.int64, device=device)
    at = 0

    def take(count: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal at
        piece = ws[at:at + count]
        at += count
        return piece.view(dtype)[: math.prod(shape)].view(shape)

    parts = (take(per_chunk, torch.float32, (n, nc)), take(per_chunk * _NB, torch.int32, (n, nc, _NB)),
             take(per_chunk * _NB, torch.int64, (n, nc, _NB)), take(per_chunk, torch.int64, (n, nc)),
             take(per_chunk, torch.float32, (n, nc)))
    return parts, take(n * buf_len, torch.int64, (n, buf_len))
