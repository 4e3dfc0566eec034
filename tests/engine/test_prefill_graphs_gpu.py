"""GPU: prefill CUDA graphs (on by default, runner/prefill_graphs.py) change no bit of any
output in deterministic mode: tokens and logprobs equal the eager engine's at batch sizes 1, 7 and 64, under
chunked prefill and preemption, for a 16-bit and an e4m3 KV cache, on a tiny random model and the
Qwen2.5-0.5B shape; the graphs really ran (get_stats: steps, buckets, capture time and memory)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_cuda_graphs_gpu import _llm, _outputs
from tests.engine.test_cuda_graphs_gpu import model as model  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefill_graphs_change_no_bit(model, kv_cache_dtype, monkeypatch):  # noqa: F811
    sizes = (1, 7, 64)
    monkeypatch.setenv("DEEPINFER_DISABLE_PREFILL_GRAPHS", "1")
    ref_llm = _llm(model, kv_cache_dtype=kv_cache_dtype)
    assert ref_llm.get_stats()["prefill_graphs_enabled"] is False   # switched off
    reference = {n: _outputs(ref_llm, n) for n in sizes}
    del ref_llm
    monkeypatch.delenv("DEEPINFER_DISABLE_PREFILL_GRAPHS")
    llm = _llm(model, kv_cache_dtype=kv_cache_dtype)   # the default
    for n in sizes:
        assert _outputs(llm, n) == reference[n], f"prefill graphs differ at batch {n}"
    stats = llm.get_stats()
    assert stats["prefill_graphs_enabled"] and stats["prefill_graph_steps"] > 0, stats
    assert stats["prefill_graph_capture_s"] > 0 and stats["prefill_graph_padded_tokens"] > 0, stats
    print(f"prefill graphs: buckets {stats['prefill_graph_buckets']}, "
          f"{stats['prefill_graph_capture_s']:.2f} s, {stats['prefill_graph_memory_bytes'] / 2**20:.1f} MiB")
    llm.engine.async_scheduling = False
    assert _outputs(llm, 7) == reference[7]


def test_prefill_graphs_under_preemption_and_chunked_prefill(model, monkeypatch):  # noqa: F811
    few_blocks = dict(num_kv_blocks=24, max_num_batched_tokens=64)
    monkeypatch.setenv("DEEPINFER_DISABLE_PREFILL_GRAPHS", "1")
    ref = _outputs(_llm(model, **few_blocks), 64)
    monkeypatch.delenv("DEEPINFER_DISABLE_PREFILL_GRAPHS")
    llm = _llm(model, **few_blocks)
    assert _outputs(llm, 64) == ref
    assert llm.get_stats()["prefill_graph_steps"] > 0
    torch.cuda.synchronize()
