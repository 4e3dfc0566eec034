"""One-pass sampling: grammar bitmask, temperature, Gumbel-max draw and argmax over each logits row.

`sample_tokens(logits, row_params, bitmask, bitmask_slots)` gives what kernels/reference/sampling.py's
`sample_tokens_ref` gives, bit for bit: each logits element is read once, masked by its bit, scaled by
1/T (IEEE division, `div_rn`, as torch's), its Gumbel noise built in registers from the counter stream
(uint64, so shifts are logical and products wrap modulo 2**64, as torch's int64 ops do), and the float64
score reduced to a running (max, lowest id) pair per lane of the program's block, the lanes combined once
after the loop (one cross-warp reduction per program instead of three per block). Greedy rows (T = 0) take
a loop of their own with float32 state (float64(x) orders exactly as x), so they run near memory speed;
rows with T > 0 are bound by the two float64 logs per token that the reproducibility contract fixes. The
noise uses libdevice `log` on float64, the function
torch's CUDA `log` kernel calls, so a score has the same bits as the torch sampler's.

Exactness and batch invariance: the vocabulary is split into fixed chunks of SPLIT tokens (a function of V
only); program (row, chunk) writes the chunk's best (score, lowest id), and a second kernel picks, per row,
the best chunk with the lowest chunk winning ties. Max with a lowest-index tie break is exact and
associative, so the split changes nothing, and no row reads another row's data. NaN follows torch.argmax:
the first NaN of a row wins. A row whose scores are all -inf yields token 0, as torch.argmax does.

Imported only from the CUDA path (or under TRITON_INTERPRET=1): it imports Triton at module level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.pdl import pdl_options, wait_for_producers
from deepinfer.kernels.reference.sampling import check_sampling_args

try:  # triton >= 3.2 dispatches libdevice by backend; older 3.x only has the CUDA module
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the installed Triton
    from triton.language.extra.cuda import libdevice

_BLOCK = 1024          # tokens per inner iteration
_MAX_SPLIT = 8192      # tokens per program (rounded up to a multiple of _BLOCK)
# Warps per program: 8 was fastest in every case measured (H200, 256 x 151,936 logits,
# benchmarks/sampling_05b.py, us with 8 / 4 warps): greedy bf16 32 / 44, temperature bf16 329 / 338,
# bitmask bf16 383 / 475; float32 logits greedy 41 with 8.
_NUM_WARPS = 8


@triton.jit
def _mix64(z):
    # splitmix64 finalizer on uint64 (logical shifts, products modulo 2**64).
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def row_key(seed, pos):
    """uint64 key of a row's noise stream from its int64 seed and output position (rng.py's row_keys)."""
    key = _mix64(seed.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15)
    return _mix64(key + (pos.to(tl.uint64, bitcast=True) + 1) * 0xD1B54A32D192ED03)


@triton.jit
def gumbel(key, idx, LIBDEVICE: tl.constexpr):
    """float64 Gumbel noise -log(-log u) of tokens idx in the stream `key` (rng.py's gumbel_noise)."""
    bits = _mix64(key + (idx.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((bits >> 12).to(tl.int64).to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52
    if LIBDEVICE:
        return -libdevice.log(-libdevice.log(u))
    return -tl.log(-tl.log(u))   # Triton's interpreter has no libdevice; numpy's log stands in


@triton.jit
def masked_logits(row_logits_ptr, row_words_ptr, idx, in_range, slot, HAS_MASK: tl.constexpr):
    # The row's logits at idx as float32 (-inf out of range), -inf where the row's grammar bitmask (slot >= 0)
    # clears the token's bit.
    x = tl.load(row_logits_ptr + idx, mask=in_range, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        if slot >= 0:
            words = tl.load(row_words_ptr + idx // 32, mask=in_range, other=0)
            x = tl.where(((words >> (idx % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, params_ptr, bitmask_ptr, slots_ptr, part_val_ptr, part_idx_ptr, noise_ptr,
    S, V, NUM_SPLITS, stride_logits, stride_params, stride_bitmask,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
    WRITE_NOISE: tl.constexpr, PDL: tl.constexpr = 0,
):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(params_ptr + 2 * stride_params + row).to(tl.int32).to(tl.float32, bitcast=True)
    start = chunk * SPLIT
    lane = tl.arange(0, BLOCK)
    # Per-lane running (best score, its id) and first NaN id; reduced across lanes once, after the loop.
    # A lane's ids only grow over the iterations, so the strict `>` keeps its lowest id among equal scores.
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = start + lane
    nan_i = tl.full([BLOCK], 2**31 - 1, tl.int32)
    if temp >= 0.0:   # temp < 0: the caller samples this row elsewhere
        key = row_key(tl.load(params_ptr + row), tl.load(params_ptr + stride_params + row))
        slot = -1
        if HAS_MASK:
            slot = tl.load(slots_ptr + row).to(tl.int64)
        if temp == 0.0:
            # Greedy: the float32 logit is the score (float64(x) orders exactly as x), so this loop keeps
            # float32 state and runs at memory speed; the best is widened to float64 after the loop.
            best32 = tl.full([BLOCK], float("-inf"), tl.float32)
            for off in range(0, SPLIT, BLOCK):
                idx = start + off + lane
                in_range = idx < V   # out-of-range lanes load -inf: never better, never NaN
                x = masked_logits(logits_ptr + row * stride_logits, bitmask_ptr + slot * stride_bitmask, idx,
                                   in_range, slot, HAS_MASK)
                nan_i = tl.minimum(nan_i, tl.where(x != x, idx, 2**31 - 1))
                better = x > best32   # false for NaN: NaNs are tracked by nan_i only
                best_i = tl.where(better, idx, best_i)
                best32 = tl.where(better, x, best32)
            best = best32.to(tl.float64)
        else:
            for off in range(0, SPLIT, BLOCK):
                idx = start + off + lane
                in_range = idx < V
                x = masked_logits(logits_ptr + row * stride_logits, bitmask_ptr + slot * stride_bitmask, idx,
                                   in_range, slot, HAS_MASK)
                noise = gumbel(key, idx, LIBDEVICE)
                if WRITE_NOISE:   # tests only: the noise itself, to compare with rng.py bit for bit
                    tl.store(noise_ptr + row * V + idx, noise, mask=in_range)
                score = tl.math.div_rn(x, temp).to(tl.float64) + noise
                score = tl.where(in_range, score, float("-inf"))
                nan_i = tl.minimum(nan_i, tl.where(score != score, idx, 2**31 - 1))
                better = score > best
                best_i = tl.where(better, idx, best_i)
                best = tl.where(better, score, best)
    m = tl.max(best, axis=0)
    m_i = tl.min(tl.where(best == m, best_i, 2**31 - 1), axis=0)
    first_nan = tl.min(nan_i, axis=0)
    has_nan = first_nan < 2**31 - 1
    out = row * NUM_SPLITS + chunk
    tl.store(part_val_ptr + out, tl.where(has_nan, float("nan"), m))
    tl.store(part_idx_ptr + out, tl.where(has_nan, first_nan, m_i).to(tl.int64))


@triton.jit
def _combine_kernel(params_ptr, part_val_ptr, part_idx_ptr, out_ptr, NUM_SPLITS, stride_params,
                    BLOCK_SPLITS: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_SPLITS)
    ok = s < NUM_SPLITS
    val = tl.load(part_val_ptr + row * NUM_SPLITS + s, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * NUM_SPLITS + s, mask=ok, other=2**62)
    is_nan = val != val
    nan_i = tl.min(tl.where(is_nan, idx, 2**62), axis=0)
    clean = tl.where(is_nan, float("-inf"), val)
    m = tl.max(clean, axis=0)
    # Chunks are in token order and each holds its lowest best id: the lowest id among equal maxima wins.
    best_i = tl.min(tl.where((clean == m) & ok, idx, 2**62), axis=0)
    token = tl.where(nan_i < 2**62, nan_i, best_i)
    temp = tl.load(params_ptr + 2 * stride_params + row).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row, tl.where(temp < 0.0, -1, token))


def _interpreted() -> bool:
    return type(_sample_chunk_kernel).__name__ == "InterpretedFunction"


def split_size(vocab: int) -> int:
    """Tokens per program: a function of V only (the result does not depend on it; speed does)."""
    return min(_MAX_SPLIT, triton.cdiv(max(vocab, 1), _BLOCK) * _BLOCK)


def sample_tokens(logits: torch.Tensor, row_params: torch.Tensor, bitmask: torch.Tensor | None = None,
                  bitmask_slots: torch.Tensor | None = None, *, split: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """int64 [S] sampled token ids (-1 for rows with a negative temperature); see the module docstring.

    logits: float32/bf16/fp16 [S, V], last dim contiguous. row_params: int64 [3, S] (pack_row_params).
    bitmask: int32 [slots, >= ceil(V/32)] with bitmask_slots int32/int64 [S] (-1 = unconstrained), or None.
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    `split` (tokens per program, a multiple of 1024; default split_size(V)) and `num_warps` (default
    8) change only the speed, never the ids (benchmarks/sampling_05b.py sweeps them).
    """
    return _launch(logits, row_params, bitmask, bitmask_slots, None, split, num_warps)


def gumbel_noise_triton(row_params: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [S, V]: the Gumbel noise the kernel adds for rows with T > 0 (for tests against rng.py)."""
    s = row_params.shape[1]
    noise = torch.full((s, vocab), float("nan"), dtype=torch.float64, device=row_params.device)
    zeros = torch.zeros((s, vocab), dtype=torch.float32, device=row_params.device)
    _launch(zeros, row_params, None, None, noise)
    return noise


def _launch(logits: torch.Tensor, row_params: torch.Tensor, bitmask: torch.Tensor | None,
            bitmask_slots: torch.Tensor | None, noise: torch.Tensor | None, split: int | None = None,
            num_warps: int | None = None) -> torch.Tensor:
    check_sampling_args(logits, row_params, bitmask, bitmask_slots)
    s, v = logits.shape
    out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s == 0:
        return out
    if v == 0:
        raise ValueError("logits: the vocabulary is empty (V=0)")
    if v >= 2**31 - 2 * _MAX_SPLIT:
        raise ValueError(f"logits: vocabulary of {v} tokens; token ids must stay well inside int32")
    if v > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: last dimension must be contiguous, got strides {tuple(logits.stride())}")
    if row_params.stride(1) != 1:
        raise ValueError("row_params: last dimension must be contiguous")
    if bitmask is not None and bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        raise ValueError("bitmask: last dimension must be contiguous")
    if split is None:
        split = split_size(v)
    elif split < _BLOCK or split % _BLOCK:
        raise ValueError(f"split={split}: must be a positive multiple of {_BLOCK}")
    num_splits = triton.cdiv(v, split)
    warps = num_warps if num_warps is not None else _NUM_WARPS
    part_val = torch.empty((s, num_splits), dtype=torch.float64, device=logits.device)
    part_idx = torch.empty((s, num_splits), dtype=torch.int64, device=logits.device)
    mask_t = bitmask if bitmask is not None else row_params      # any pointer; unused without HAS_MASK
    slots_t = bitmask_slots if bitmask_slots is not None else row_params
    _sample_chunk_kernel[(s, num_splits)](
        logits, row_params, mask_t, slots_t, part_val, part_idx, noise if noise is not None else part_val,
        s, v, num_splits, logits.stride(0), row_params.stride(0), mask_t.stride(0),
        HAS_MASK=bitmask is not None, SPLIT=split, BLOCK=_BLOCK, LIBDEVICE=not _interpreted(),
        WRITE_NOISE=noise is not None, num_warps=warps, **pdl_options(logits.device),
    )
    _combine_kernel[(s,)](row_params, part_val, part_idx, out, num_splits, row_params.stride(0),
                          BLOCK_SPLITS=triton.next_power_of_2(num_splits), num_warps=1,
                          **pdl_options(logits.device))
    return out
