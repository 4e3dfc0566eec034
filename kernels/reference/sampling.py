"""Plain-torch reference of the one-pass sampling kernel (kernels/sampling.py), and the shared arg checks.

Per row r of float logits [S, V]:
  x = logits[r] as float32, with x[v] = -inf where the row's grammar bitmask row (slot[r] >= 0) clears bit v
  temperature T = 0: token = argmax(x) (lowest id on ties)
  T > 0:            token = argmax(float64(x / T) + G(key_r, v)), G = -log(-log u) Gumbel noise
  T < 0:            the row is skipped (token -1; the caller draws it another way)
The noise is the splitmix64-style counter stream of deepinfer's sampler (engine/sample/rng.py, a
reproducibility contract): key_r = mix(mix(seed + GOLDEN) + (position + 1) * POS_STEP),
bits = mix(key_r + (v + 1) * GOLDEN), u = (bits >>> 12 + 1/2) * 2**-52. It is written out again here (kernels/
never imports deepinfer.engine), so this file is an independent check of both the kernel and rng.py.

Row parameters travel as one int64 tensor [3, S] (one host->device copy per step): row 0 the seeds (64-bit
patterns), row 1 the output positions, row 2 the float32 bit pattern of the temperature (`pack_row_params`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GOLDEN = -0x61C8864680B583EB        # 0x9E3779B97F4A7C15 as a signed int64
MUL1 = -0x40A7B892E31B1A47          # 0xBF58476D1CE4E5B9
MUL2 = -0x6B2FB644ECCEEE15          # 0x94D049BB133111EB
POS_STEP = -0x2E4AB5CD2E6D12FD      # 0xD1B54A32D192ED03
UNIFORM_BITS = 52


def pack_row_params(temperatures: Sequence[float] | float, seeds: Sequence[int], positions: Sequence[int]
                    ) -> torch.Tensor:
    """int64 [3, S] on the host: seeds (already reduced to signed int64), positions, float32 bits of T
    (one float: the same T for every row)."""
    temps = (torch.full((len(seeds),), temperatures, dtype=torch.float32)
             if isinstance(temperatures, float) else torch.tensor(list(temperatures), dtype=torch.float32))
    return torch.stack([_i64(seeds), _i64(positions), _f32_bits(temps)])


def _i64(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _f32_bits(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """int64 of the float32 bit patterns of `values` (how packed parameters carry a float32)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.float32)
    return t.view(torch.int32).to(torch.int64)


# Rows of the filter kernel's packed parameters (kernels/sampling_filter.py), one column per filtered row.
FILTER_FIELDS = ("rows", "seeds", "positions", "top_k", "temperature", "top_p", "min_p")


def pack_filter_params(rows: Sequence[int], temperatures: Sequence[float], seeds: Sequence[int],
                       positions: Sequence[int], top_k: Sequence[int], top_p: Sequence[float],
                       min_p: Sequence[float]) -> torch.Tensor:
    """int64 [7, F] on the host, rows as FILTER_FIELDS: batch row indices, seeds (signed int64), positions,
    top-k (V when off), the float32 bits of T (> 0), the float64 bits of top-p (1.0 when off) and the
    float32 bits of min-p (0.0 when off). One tensor, so a step moves them to the device in one copy."""
    return torch.stack([_i64(rows), _i64(seeds), _i64(positions), _i64(top_k), _f32_bits(temperatures),
                        torch.tensor(list(top_p), dtype=torch.float64).view(torch.int64), _f32_bits(min_p)])


def unpack_temperature(row_params: torch.Tensor) -> torch.Tensor:
    """float32 [S] temperatures from packed row params."""
    return row_params[2].to(torch.int32).view(torch.float32)


def check_sampling_args(logits: torch.Tensor, row_params: torch.Tensor | None, bitmask: torch.Tensor | None,
                        bitmask_slots: torch.Tensor | None) -> None:
    """ValueError naming the argument unless the shapes, dtypes and devices fit together (row_params None:
    a caller without them, the filter kernels, checks the rest)."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits: expected float32/bf16/fp16 [S, V], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    s, v = logits.shape
    if row_params is not None and (row_params.dtype != torch.int64 or tuple(row_params.shape) != (3, s)):
        raise ValueError(f"row_params: expected int64 [3, {s}] (see pack_row_params), got "
                         f"{row_params.dtype} {tuple(row_params.shape)}")
    if row_params is not None and row_params.device != logits.device:
        raise ValueError(f"row_params: on {row_params.device}, logits on {logits.device}")
    if (bitmask is None) != (bitmask_slots is None):
        raise ValueError("bitmask and bitmask_slots must be given together")
    if bitmask is None or bitmask_slots is None:
        return
    words = (v + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] < words:
        raise ValueError(f"bitmask: expected int32 [slots, >= {words}] for V={v}, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if bitmask_slots.dtype not in (torch.int32, torch.int64) or tuple(bitmask_slots.shape) != (s,):
        raise ValueError(f"bitmask_slots: expected int32/int64 [{s}] (-1 = unconstrained), got "
                         f"{bitmask_slots.dtype} {tuple(bitmask_slots.shape)}")
    if bitmask.device != logits.device or bitmask_slots.device != logits.device:
        raise ValueError(f"bitmask/bitmask_slots: on {bitmask.device}/{bitmask_slots.device}, "
                         f"logits on {logits.device}")


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)      # logical shift of an int64 bit pattern


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * MUL1
    z = (z ^ _shr(z, 27)) * MUL2
    return z ^ _shr(z, 31)


def gumbel_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [S, V] Gumbel noise of rows (seed, position) for tokens 0..V-1."""
    key = _mix(_mix(seeds + GOLDEN) + (positions + 1) * POS_STEP)
    tok = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    bits = _mix(key.unsqueeze(1) + ((tok + 1) * GOLDEN).unsqueeze(0))
    u = (_shr(bits, 64 - UNIFORM_BITS).to(torch.float64) + 0.5) * (2.0 ** -UNIFORM_BITS)
    return -torch.log(-torch.log(u))


def apply_bitmask_ref(x: torch.Tensor, bitmask: torch.Tensor, bitmask_slots: torch.Tensor) -> torch.Tensor:
    """x with -inf where a constrained row's (slot >= 0) bitmask row clears the token's bit (out of place)."""
    v = x.shape[1]
    slots = bitmask_slots.to(torch.int64)
    words = bitmask[slots.clamp(min=0), : (v + 31) // 32].to(torch.int64)
    tok = torch.arange(v, device=x.device)
    bit = (words[:, tok // 32] >> (tok % 32)) & 1
    allowed = (bit != 0) | (slots < 0).unsqueeze(1)
    return x.masked_fill(~allowed, float("-inf"))


def sample_tokens_ref(logits: torch.Tensor, row_params: torch.Tensor, bitmask: torch.Tensor | None = None,
                      bitmask_slots: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [S]: the kernel's result computed with torch ops (see the module docstring)."""
    check_sampling_args(logits, row_params, bitmask, bitmask_slots)
    x = logits.to(torch.float32)
    if bitmask is not None and bitmask_slots is not None:
        x = apply_bitmask_ref(x, bitmask, bitmask_slots)
    temp = unpack_temperature(row_params)
    scaled = (x / torch.where(temp > 0, temp, torch.ones_like(temp)).unsqueeze(1)).to(torch.float64)
    noisy = scaled + gumbel_ref(row_params[0], row_params[1], x.shape[1])
    score = torch.where((temp > 0).unsqueeze(1), noisy, x.to(torch.float64))
    out = torch.argmax(score, dim=1)
    return torch.where(temp < 0, torch.full_like(out, -1), out)
