"""GEMM pipeline depth capped by the device's shared memory (kernels/_checks.stages_that_fit): the tables
tuned on the H200 launch unchanged there, and with fewer stages (the same bits: stages never change a dot
chain) on GPUs with less shared memory per program, where the deepest tiles would otherwise fail to launch."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels import _checks

# Shared memory per program (opt-in maximum) as CUDA reports it.
H200, A100, L40S = 232_448, 166_912, 101_376
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def smem(monkeypatch):
    def set_limit(limit: int) -> None:
        _checks.stages_that_fit.cache_clear()    # its results are cached per (stages, bytes, device)
        monkeypatch.setattr(_checks, "_smem_of", lambda index: limit)
    yield set_limit
    _checks.stages_that_fit.cache_clear()


def _bf16_tables():
    from deepinfer.kernels import matmul as mm

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), *mm._TUNED]
    for n, k in shapes:
        for _, cfg in mm._bucket_configs(n, k, torch.bfloat16):
            yield f"bf16 {n}x{k} {cfg}", cfg.num_stages, (cfg.block_m + cfg.block_n) * cfg.block_k * 2


def _rowwise_tables():
    from deepinfer.kernels import fp8_rowwise as fr

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1152, 896), (4864, 896)]:
        for _, cfg in fr.rowwise_buckets(n, k):
            yield (f"fp8 {n}x{k} {cfg}", cfg["num_stages"],
                   (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"])


def _tables():
    return [*_bf16_tables(), *_rowwise_tables()]


def test_the_tables_tuned_on_the_h200_are_unchanged_there(smem):
    smem(H200)
    changed = [name for name, stages, stage_bytes in _tables()
               if _checks.stages_that_fit(stages, stage_bytes, CUDA0) != stages]
    assert not changed


@pytest.mark.parametrize("limit", [A100, L40S])
def test_smaller_devices_get_fewer_stages_that_fit(smem, limit):
    smem(limit)
    reduced = 0
    for name, stages, stage_bytes in _tables():
        fit = _checks.stages_that_fit(stages, stage_bytes, CUDA0)
        assert 1 <= fit <= stages, name
        assert fit == 1 or fit * stage_bytes + _checks.SMEM_ALLOWANCE <= limit, name
        assert fit == stages or (fit + 1) * stage_bytes + _checks.SMEM_ALLOWANCE > limit, name  # the most
        reduced += fit < stages
    assert reduced   # the 8-stage decode tiles and 4-stage 128 x 256 prefill tiles need more than these have


@pytest.mark.parametrize("device,limit", [(torch.device("cpu"), L40S), (CUDA0, 0)])
def test_unchanged_off_cuda_or_without_a_reported_limit(smem, device, limit):
    smem(limit)
    assert _checks.stages_that_fit(8, 24_576, device) == 8


def _captured_launch(monkeypatch, kernel) -> dict:
    seen: dict = {}
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: seen.update(kwargs))
    return seen


def test_bi_linear_launches_with_the_stages_that_fit(monkeypatch):
    from deepinfer.kernels import matmul as mm

    calls = []
    monkeypatch.setattr(mm, "stages_that_fit", lambda stages, stage_bytes, device: calls.append(
        (stages, stage_bytes)) or 2)
    seen = _captured_launch(monkeypatch, mm._bi_linear_kernel)
    cfg = mm.MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=8)
    mm.bi_linear(torch.zeros(5, 64, dtype=torch.bfloat16), torch.zeros(96, 64, dtype=torch.bfloat16), None,
                 config=cfg)
    assert calls == [(8, (64 + 128) * 64 * 2)] and seen["num_stages"] == 2


def test_rowwise_fp8_gemm_launches_with_the_stages_that_fit(monkeypatch):
    from deepinfer.kernels import fp8_rowwise as fr

    calls = []
    monkeypatch.setattr(fr, "stages_that_fit", lambda stages, stage_bytes, device: calls.append(
        (stages, stage_bytes)) or 3)
    seen = _captured_launch(monkeypatch, fr._rowwise_gemm_kernel)
    cfg = fr._cfg(64, 128, 128, 4, 8)
    xq = torch.zeros(5, 128, dtype=torch.float8_e4m3fn)
    weight = torch.zeros(96, 128, dtype=torch.float8_e4m3fn)
    fr.rowwise_matmul(xq, torch.ones(5, 1), weight, torch.ones(96, 1), None, torch.bfloat16, cfg)
    assert calls == [(8, (64 + 128) * 128)] and seen["num_stages"] == 3
