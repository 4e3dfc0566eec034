"""KV-cache sizing from device memory (CPU-run: CUDA's memory query is replaced by fixed figures): how many
blocks fit, and, when none does, an error that shows the arithmetic and what to change."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.core import kv_cache
from deepinfer.engine.core.config import CacheConfig
from deepinfer.engine.core.kv_cache import KVCacheSpec, blocks_that_fit

GIB = 1 << 30
SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


@pytest.fixture
def device_memory(monkeypatch):
    """Set (free, total) bytes that `torch.cuda.mem_get_info` reports."""
    state = {}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: state["info"])
    return lambda free, total: state.update(info=(free, total))


@pytest.mark.parametrize("util,free_gib,total_gib", [(0.9, 120, 140), (0.5, 139, 140), (0.5, 100, 140)])
def test_blocks_fill_the_share_left_after_what_is_in_use(device_memory, util, free_gib, total_gib):
    device_memory(free_gib * GIB, total_gib * GIB)
    n = blocks_that_fit(SPEC, CacheConfig(gpu_memory_utilization=util), torch.device("cuda"))
    reserve = kv_cache._CUDA_ACTIVATION_RESERVE_BYTES
    budget = int(total_gib * GIB * util) - (total_gib - free_gib) * GIB - reserve
    assert n == budget // SPEC.bytes_per_block


@pytest.mark.parametrize("util,free_gib", [(0.3, 40), (0.5, 60), (0.02, 139)])
def test_no_room_names_the_share_the_memory_in_use_and_the_fixes(device_memory, util, free_gib):
    device_memory(free_gib * GIB, 140 * GIB)
    with pytest.raises(ValueError) as err:
        blocks_that_fit(SPEC, CacheConfig(gpu_memory_utilization=util), torch.device("cuda"))
    msg = str(err.value)
    assert f"gpu_memory_utilization={util} of 140.00 GiB is {140 * util:.2f} GiB" in msg
    assert f"{140 - free_gib:.2f} GiB of the device is already in use" in msg
    for fix in ("raise gpu_memory_utilization", "free the device", "num_kv_blocks"):
        assert fix in msg


def test_cpu_cache_too_small_for_one_block_names_cpu_kv_cache_gib():
    with pytest.raises(ValueError, match=r"cpu_kv_cache_gib=0\.001.*raise cpu_kv_cache_gib"):
        blocks_that_fit(SPEC, CacheConfig(cpu_kv_cache_gib=0.001), torch.device("cpu"))


def test_an_explicit_block_count_is_taken_as_given(device_memory):
    device_memory(0, 140 * GIB)
    assert blocks_that_fit(SPEC, CacheConfig(num_blocks=7), torch.device("cuda")) == 7
