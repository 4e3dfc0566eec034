"""FP8 (e4m3) tensor math shared by the loader: block quantizer, dequantizer and the engine's scale layout.

Checkpoint layouts (every scale *multiplies* the e4m3 value back: w = q * s):
- block: `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] float32, one scale per bn x bk tile (DeepSeek-V3's
  release, HF transformers' FineGrainedFP8 writer); tiles at the right/bottom edge may be partial.
- channel: `weight_scale` [N, 1] (or [N]), one scale per output row ("FP8-Dynamic" compressed-tensors).
- tensor: `weight_scale` of one element, one scale for the whole weight.

The engine's own layout (what the FP8 GEMM reads) is "row scales": [N, ceil(K / group)] float32, a scale per
output row and per K-group of `group` columns. Every checkpoint layout maps onto it exactly (block rows
repeated, channel/tensor scales broadcast) as long as a block's K extent is a multiple of the group, and it
merges across q/k/v or gate/up by plain row offsets, whatever the shard sizes.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 [..., N, K], weight_scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]).

    The arithmetic is HF transformers' `Fp8Quantize` (scale = 448 / amax of the tile in float32, stored
    inverted as 1 / scale; q = clamp(w * scale, +-448) rounded to nearest e4m3; an all-zero tile gets scale
    1), extended to partial edge tiles as DeepSeek's checkpoints have them: the tile's amax is over the
    elements it holds. For shapes that divide by the block this is bitwise what transformers writes.
    """
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"block {block}: both sizes must be >= 1")
    if weight.dim() < 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: expected [..., N, K]")
    *lead, n, k = weight.shape
    rows, cols = _cdiv(n, bn), _cdiv(k, bk)
    w = weight.to(torch.float32)
    if rows * bn != n or cols * bk != k:  # zero padding leaves every tile's amax unchanged
        w = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    tiles = w.reshape(*lead, rows, bn, cols, bk)
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv = (1.0 / scales).to(torch.float32)
    q = torch.clamp(tiles * scales.unsqueeze(-1).unsqueeze(-3), min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, rows * bn, cols * bk)[..., :n, :k].contiguous()
    return q, inv


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 [..., N, K], weight_scale float32 [..., N, 1]), one scale per output
    channel with the arithmetic of llm-compressor's "FP8-Dynamic" checkpoints (s = amax / 448, at least
    the smallest normal float32; q = clamp(w / s, +-448) rounded to nearest e4m3), so quantizing at load
    equals loading such a checkpoint made from the same weights."""
    if weight.dim() < 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: expected [..., N, K]")
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _block_of(grid: tuple[int, int], n: int, k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """The (bn, bk) tile of a scale grid: the checkpoint's `block` when known (partial edge tiles make the
    grid alone ambiguous), else inferred from a grid that divides the weight exactly."""
    rows, cols = grid
    if block is None:
        if n % rows or k % cols:
            raise ValueError(f"scale grid {grid} does not divide a [{n}, {k}] weight and no block size is "
                             "known")
        block = (n // rows, k // cols)
    bn, bk = block
    if _cdiv(n, bn) != rows or _cdiv(k, bk) != cols:
        raise ValueError(f"scale grid {grid} does not tile a [{n}, {k}] weight in {bn} x {bk} blocks")
    return bn, bk


def expand_block_scales(scale: torch.Tensor, n: int, k: int,
                        block: tuple[int, int] | None = None) -> torch.Tensor:
    """Any checkpoint scale (block grid, per channel, per tensor) -> float32 [N, K] elementwise scales."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, k)
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1 and s.shape[0] == n):
        if s.numel() != n:
            raise ValueError(f"per-channel scale of shape {tuple(scale.shape)} for a weight with {n} rows")
        return s.reshape(n, 1).expand(n, k)
    if s.dim() != 2:
        raise ValueError(f"scale of shape {tuple(scale.shape)}: expected a block grid, [N, 1] or one value")
    bn, bk = _block_of(tuple(s.shape), n, k, block)
    return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """e4m3 [N, K] (or [E, N, K] with a scale per expert) and its checkpoint scale -> float32 weights.

    One float32 product per element, like transformers' `Fp8Dequantize`; the caller rounds once to the
    model's dtype when copying into the parameter.
    """
    if q.dim() == 3:
        return torch.stack([dequantize_fp8(q[e], scale[e] if scale.numel() > 1 else scale, block)
                            for e in range(q.shape[0])])
    n, k = q.shape
    return q.to(torch.float32) * expand_block_scales(scale, n, k, block)


def row_scales(scale: torch.Tensor, n: int, k: int, group: int,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """A checkpoint scale -> the engine layout float32 [N, ceil(K / group)] (see the module docstring).

    ValueError when a block's K extent is not a multiple of `group` (a K-group would span two scales).
    """
    s = scale.to(torch.float32)
    groups = _cdiv(k, group)
    if s.dim() == 2 and s.numel() > 1 and not (s.shape[1] == 1 and s.shape[0] == n):
        bn, bk = _block_of(tuple(s.shape), n, k, block)
        starts = torch.arange(groups) * group
        ends = torch.clamp(starts + group, max=k) - 1
        first, last = starts // bk, ends // bk
        if not torch.equal(first, last):
            raise ValueError(f"block scales with K block {bk} cannot feed K-groups of {group} (a group would "
                             "span two scales); pick a group that divides the block")
        return s.repeat_interleave(bn, 0)[:n][:, first].contiguous()
    full = expand_block_scales(s, n, group * groups, block)  # channel / tensor: constant along K
    return full[:, ::group].contiguous()


def interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [a | b] (2I rows, a leading dimension) -> a0, b0, a1, b1, ...: a gate_up weight's (or bias's)
    order for a GEMM with the SwiGLU in its epilogue (kernels/matmul.bi_linear's `swiglu`). Any dtype."""
    two_i = t.shape[0]
    if two_i % 2:
        raise ValueError(f"interleave_halves: {two_i} rows, expected an even count")
    order = torch.arange(two_i, device=t.device).view(2, two_i // 2).t().reshape(-1)
    rows = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    return rows.index_select(0, order).view(t.dtype).contiguous()


def interleave_gate_up(weight: torch.Tensor,
                       weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate_up weight [2I, K] with its per-channel scales [2I, 1], rows [gate | up] -> rows alternating
    gate j, up j (rows 2j, 2j + 1): the order kernels/fp8_rowwise.fp8_rowwise_swiglu_quantized reads. A
    row's products do not depend on where the row sits in the weight, so the GEMM's elements keep their
    bits."""
    two_i = weight.shape[0]
    if two_i % 2 or tuple(weight_scale.shape) != (two_i, 1):
        raise ValueError(f"interleave_gate_up: weight {tuple(weight.shape)}, scale "
                         f"{tuple(weight_scale.shape)}: expected [2I, K] and [2I, 1]")
    return interleave_halves(weight), interleave_halves(weight_scale)

