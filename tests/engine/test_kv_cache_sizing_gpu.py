"""KV-cache sizing on CUDA counts memory the caching allocator holds but no tensor uses as free: weights
freed just before sizing (a quantize-at-load replaces the bf16 weights it read) go to the cache, not to
nothing."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.core.config import CacheConfig
from deepinfer.engine.core.kv_cache import KVCacheSpec, blocks_that_fit

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("freed_gib", [1, 4])
def test_memory_freed_before_sizing_counts_as_free(freed_gib: int) -> None:
    device = torch.device("cuda")
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    cfg = CacheConfig(gpu_memory_utilization=0.5)
    before = blocks_that_fit(spec, cfg, device)
    held = torch.empty(freed_gib << 30, dtype=torch.uint8, device=device)
    del held  # freed, but still reserved by the caching allocator
    assert torch.cuda.memory_reserved(device) >= freed_gib << 30  # the case this test is about
    assert blocks_that_fit(spec, cfg, device) == before
