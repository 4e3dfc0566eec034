"""Batch-invariant elementwise transcendental functions on CPU.

torch's CPU elementwise kernels run a vectorised implementation over whole SIMD blocks and a scalar one
over the leftover tail (and over each thread's share when a large tensor is split across threads). For
exp-based functions (sigmoid, silu, ...) the two can round differently, so an element's result could
depend on where it falls in the tensor, i.e. on the rest of the batch. `fixed_path` pads the flattened
input to whole SIMD blocks and feeds it in fixed pieces below torch's parallel grain size, so every
element takes the vectorised path on one thread, whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# A multiple of two vectors of the widest CPU SIMD torch uses (AVX512: 16 float32 / 32 bfloat16 lanes),
# since torch's vectorised loop steps over two vectors at a time.
VEC_TILE = 64
# Below at::internal::GRAIN_SIZE (32768): a piece is never split across threads.
PIECE = 16384


def fixed_path(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed so that each element's bits depend only on its value."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = -(-n // VEC_TILE) * VEC_TILE
    # A fresh buffer: contiguous and allocator-aligned, whatever x's layout.
    flat = F.pad(flat, (0, padded - n)) if padded != n else flat.clone()
    if padded <= PIECE:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i:i + PIECE]) for i in range(0, padded, PIECE)])
    return out[:n].view(x.shape)
