"""The per-weight-shape bucket table of the batch-invariant GEMM (kernels/matmul.py `_TUNED`): pure Python
config logic, checked on CPU. A tuned shape keeps BLOCK_K = 64 and one split_k in every bucket and in
matmul_config (the planner's fallback is its open-ended config), keeps its shape class's prefill config
unless it adopts split-K, covers every M with ascending bounds, and never looks at M (GPU bit checks at
the Qwen2.5-0.5B shapes: test_bi_linear_05b_gpu.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

QWEN_05B = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)]
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.fixture(scope="module")
def mm():
    from deepinfer.kernels import matmul

    return matmul


def _untuned(mm, n: int, k: int, monkeypatch) -> tuple:
    with monkeypatch.context() as m:
        m.setattr(mm, "_TUNED", {})
        return mm._bucket_configs(n, k, torch.bfloat16)


@pytest.mark.parametrize("n,k", QWEN_05B + LLAMA_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_buckets_keep_block_k_the_prefill_config_and_cover_every_m(mm, n, k, dtype, monkeypatch):
    buckets = mm._bucket_configs(n, k, dtype)
    bounds = [b for b, _ in buckets[:-1]]
    assert buckets[-1][0] is None and bounds == sorted(set(bounds)) and all(b > 0 for b in bounds)
    assert {cfg.block_k for _, cfg in buckets} == {mm.matmul_config(n, k, dtype).block_k} == {64}
    # split-K changes the bits: one split_k for every bucket and for matmul_config (the planner's fallback)
    assert {cfg.split_k for _, cfg in buckets} == {mm.matmul_config(n, k, dtype).split_k}
    if buckets[-1][1].split_k == 1:
        assert buckets[-1] == _untuned(mm, n, k, monkeypatch)[-1]
    if (n, k) in mm._TUNED:
        assert mm.matmul_config(n, k, dtype) == buckets[-1][1]
    assert buckets == mm._bucket_configs(n, k, dtype)


def test_table_is_keyed_by_the_weight_only_and_leaves_other_shapes_alone(mm, monkeypatch):
    assert set(inspect.signature(mm._bucket_configs).parameters) == {"n", "k", "dtype"}
    for key, entries in mm._TUNED.items():
        assert len(key) == 2 and all(isinstance(v, int) for v in key)
        assert all(isinstance(b, int) and isinstance(c, mm.MatmulConfig) for b, c in entries[:-1])
        assert entries[-1][0] is None and isinstance(entries[-1][1], mm.MatmulConfig)
    for n, k in LLAMA_8B:   # the 8B shapes: tuned decode buckets or the class rule, the class's prefill tile
        buckets = mm._bucket_configs(n, k, torch.bfloat16)
        assert (n, k) in mm._TUNED or buckets == _untuned(mm, n, k, monkeypatch)
        assert buckets[-1] == _untuned(mm, n, k, monkeypatch)[-1]
    assert mm._bucket_configs(896, 896, torch.float32) == ((None, mm.matmul_config(896, 896, torch.float32)),)
