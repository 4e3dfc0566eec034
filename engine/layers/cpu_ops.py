"""CPU ops backends: batch-invariant pure torch (deterministic) and plain torch (fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.attention import chunked_paged_attention, paged_attention_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref

# torch.mm on CPU is not row-invariant (the kernel it picks depends on M), but on a fixed M of exactly
# this many rows it is: each row's result then depends only on that row.
LINEAR_ROW_CHUNK = 32
# Allocator alignment of fresh CPU tensors; chunks that start elsewhere are copied so the BLAS kernel
# never sees a differently aligned operand for the same row.
_ALIGN_BYTES = 64


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
        return rms_norm_ref(x, weight, eps, invariant=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x, invariant=True)

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
        return rms_norm_ref(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
