"""The numeric-ops interface the models call (backends.make_ops picks an implementation for a device).

Every backend implements the same methods. With `deterministic=True` each op is batch-invariant: a row's
result is bitwise the same whatever other rows share the call, how a prompt was split into prefill chunks
and whether its prefix came from the cache.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.store_kv import store_kv_ref


class Ops:
    """Base class: shared op implementations; backends override what they compute differently."""

    name = "base"
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Row-wise RMSNorm over the last dim of x [M, H]: float32 statistics as in transformers."""
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); residual None means x alone is the new residual."""
        summed = x if residual is None else residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, 2I] = [gate | up] -> silu(gate) * up [M, I]."""
        raise NotImplementedError

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at flat slots [T]."""
        store_kv_ref(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal paged attention: q [T, Hq, D] -> [T, Hq, D].

        The query token at absolute position p attends to positions [0, p] of its own sequence, all read
        from the cache (after `store_kv` wrote this step's k/v). Hq is a multiple of Hkv (GQA).
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(deterministic={self.deterministic})"
