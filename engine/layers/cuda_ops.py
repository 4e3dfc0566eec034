"""CUDA ops backends over deepinfer's Triton kernels (imported only when a CUDA backend is built)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.metadata import AttentionMetadata


def _kernels():
    """Import the Triton kernel modules; a clear error when they (or triton) are unavailable."""
    try:
        from deepinfer.kernels import activation, matmul, paged_attention, rmsnorm, store_kv
    except ImportError as e:
        raise RuntimeError(
            f"CUDA ops need deepinfer's Triton kernels (deepinfer.kernels) and triton: {e}"
        ) from e
    return matmul, rmsnorm, paged_attention, activation, store_kv


class _CudaOps(Ops):
    """Triton norm, activation, KV store and paged attention; subclasses choose the matmul."""

    def __init__(self) -> None:
        (self._matmul, self._rmsnorm, self._attention, self._activation,
         self._store_kv) = _kernels()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rmsnorm.rms_norm(x, weight, eps), x
        return self._rmsnorm.rms_norm(x, weight, eps, residual=residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._activation.silu_and_mul(x)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._store_kv.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attention.paged_attention(q, k_cache, v_cache, meta, scale)


class CudaInvariantOps(_CudaOps):
    """Every op a batch-invariant Triton kernel (fixed tiling that never depends on the batch)."""

    name = "cuda-invariant"
    deterministic = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul.bi_linear(x, weight, bias)


class CudaFastOps(_CudaOps):
    """cuBLAS matmuls (fastest, not batch-invariant) with the Triton attention and norm kernels."""

    name = "cuda-fast"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
