"""Shared pytest fixtures: tiny checkpoints built once per session; gpu-marked tests skipped without CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import TINY_ARCHS, make_tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models gain nothing from intra-op threads, and on a 2-core CI machine shared with Ray workers
    # and subprocess jobs, OpenMP spin-waiting threads slow every op down by an order of magnitude.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `tiny_checkpoint(arch, dtype=torch.float32, seed=0) -> Path`, each built once per session."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[tuple[str, torch.dtype, int], Path] = {}

    def get(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
        if arch not in TINY_ARCHS:
            raise ValueError(f"arch={arch!r}: expected one of {TINY_ARCHS}")
        key = (arch, dtype, seed)
        if key not in cache:
            name = f"{arch}-{str(dtype).removeprefix('torch.')}-{seed}"
            cache[key] = make_tiny_checkpoint(arch, root / name, seed=seed, dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> str:
    """The tiny float32 Llama checkpoint most engine and pipeline tests run on (its directory)."""
    return str(tiny_checkpoint("llama"))
