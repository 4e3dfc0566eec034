"""CPU ops backends: batch-invariant pure torch (deterministic) and plain torch (fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .cpu_attention import chunked_paged_attention, gathered_paged_attention
from .ops import Ops
from .pointwise import fixed_path

# torch.mm on CPU is not row-invariant (the kernel it picks depends on M), but on a fixed M of exactly
# this many rows it is: each row's result then depends only on that row.
LINEAR_ROW_CHUNK = 32
# Allocator alignment of fresh CPU tensors; chunks that start elsewhere are copied so the BLAS kernel
# never sees a differently aligned operand for the same row.
_ALIGN_BYTES = 64


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: float32 statistics, cast back, then scale.
    xf = x.to(torch.float32)
    variance = (xf * xf).mean(-1, keepdim=True) + eps
    inv = fixed_path(torch.rsqrt, variance) if invariant else torch.rsqrt(variance)
    return weight * (xf * inv).to(x.dtype)


class CpuInvariantOps(Ops):
    """Batch-invariant CPU ops: `f(x)[i]` is bitwise `f(x[i:i+1])[0]` for every op."""

    name = "cpu-invariant"
    deterministic = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, k = x.shape
        padded_rows = -(-rows // LINEAR_ROW_CHUNK) * LINEAR_ROW_CHUNK
        xp = x.new_zeros((padded_rows, k))
        xp[:rows] = x
        aligned = (k * x.element_size()) % _ALIGN_BYTES == 0
        wt = weight.t()
        chunks = []
        for i in range(0, padded_rows, LINEAR_ROW_CHUNK):
            chunk = xp[i:i + LINEAR_ROW_CHUNK]
            chunks.append(torch.mm(chunk if aligned else chunk.clone(), wt))
        out = torch.cat(chunks)[:rows]
        return out + bias if bias is not None else out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm_reference(x, weight, eps, invariant=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return fixed_path(F.silu, gate) * up

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return chunked_paged_attention(q, k_cache, v_cache, meta, scale)


class CpuFastOps(Ops):
    """Plain torch CPU ops (not batch-invariant): the simple, correct reference path."""

    name = "cpu-fast"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm_reference(x, weight, eps, invariant=False)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return gathered_paged_attention(q, k_cache, v_cache, meta, scale)
