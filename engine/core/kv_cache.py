"""Paged KV cache storage: one (k_cache, v_cache) pair per layer, sized from device memory or a setting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from deepinfer.engine.core.config import CacheConfig

# Memory kept free on CUDA for activations of the largest step, beyond what profiling sees.
_CUDA_ACTIVATION_RESERVE_BYTES = 2 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCacheLayout(Protocol):
    """What sizing needs of a cache layout: KVCacheSpec, or a model's own (e.g. MLA's latent cache)."""

    @property
    def bytes_per_block(self) -> int: ...


def cache_layout_for(model: Any, default: KVCacheSpec) -> KVCacheLayout:
    """The model's own layout when it declares one (`kv_cache_spec(block_size, dtype)`), else `default`.

    Block tables, slots, prefix caching and preemption never look inside a block, so a model may keep any
    per-token contents there (DeepSeek's MLA keeps one compressed latent per token and layer).
    """
    own = getattr(model, "kv_cache_spec", None)
    return default if own is None else own(default.block_size, default.dtype)


def allocate_kv_cache_for(model: Any, spec: KVCacheLayout, num_blocks: int, device: torch.device) -> list:
    """Per-layer caches in the model's layout (`allocate_kv_cache`), else per-head (k_cache, v_cache)."""
    own = getattr(model, "allocate_kv_cache", None)
    return allocate_kv_cache(spec, num_blocks, device) if own is None else own(spec, num_blocks, device)


def blocks_that_fit(spec: KVCacheLayout, cfg: CacheConfig, device: torch.device) -> int:
    """How many blocks fit: `cfg.num_blocks` when set; else from free CUDA memory or `cpu_kv_cache_gib`."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if device.type == "cuda":
        # Memory the caching allocator holds but no tensor uses (e.g. the bf16 weights a quantize-at-load
        # just replaced) counts as used in mem_get_info: hand it back first, or the cache loses it.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free    # this engine's weights and whatever other processes hold
        share = int(total * cfg.gpu_memory_utilization)
        budget = share - in_use - _CUDA_ACTIVATION_RESERVE_BYTES
        why = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {_gib(total)} is {_gib(share)}, "
               f"{_gib(in_use)} of the device is already in use (this engine's weights and other "
               f"processes), {_gib(_CUDA_ACTIVATION_RESERVE_BYTES)} is kept for activations")
        fix = ("raise gpu_memory_utilization, free the device (other processes), or set num_kv_blocks "
               "(LLM(num_kv_blocks=...))")
    else:
        budget = int(cfg.cpu_kv_cache_gib * (1 << 30))
        why, fix = f"cpu_kv_cache_gib={cfg.cpu_kv_cache_gib}", "raise cpu_kv_cache_gib"
    n = budget // spec.bytes_per_block
    if n < 1:
        raise ValueError(
            f"no room for a KV cache on {device}: {why}, which leaves {_gib(budget)} and one block needs "
            f"{spec.bytes_per_block / 2**20:.2f} MiB; {fix}"
        )
    return int(n)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-initialised so that padded/unused slots never hold NaNs that a masked read could propagate.
    """
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    zeros = lambda: torch.zeros(shape, dtype=spec.dtype, device=device)  # noqa: E731
    return [(zeros(), zeros()) for _ in range(spec.num_layers)]
