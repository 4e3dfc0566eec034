"""Shared pytest fixtures: tiny checkpoints built once per session, one local Ray for the modules that share
it (tests/support/ray_local.py); gpu-marked tests skipped without CUDA."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.support import interpreted, ray_local
from tests.support.tiny_models import TINY_ARCHS, make_tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models gain nothing from intra-op threads, and on a 2-core CI machine shared with Ray workers
    # and subprocess jobs, OpenMP spin-waiting threads slow every op down by an order of magnitude.
    torch.set_num_threads(1)
    # The same for every process the tests start (submit subprocesses, interpreter runs, Ray workers): with
    # torch's default of one thread per core, a 600-row tiny-model job took 4-5x the CPU time on 2 cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A tiny model's job needs a few MiB of KV cache; zeroing the CPU default of 1 GiB took 0.7 s a submit.
    os.environ.setdefault("DEEPINFER_CPU_KV_CACHE_GIB", "0.0625")
    config.addinivalue_line("markers", "interpreted(path): a launcher of a Triton-interpreter test file "
                            "(tests/support/interpreted.py runs the session's files in one process)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[ray_local.LAST_USER] = ray_local.group_ray_modules(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The Triton-interpreter files run in one background process beside the rest of the suite.
    interpreted.start_batch(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    interpreted.stop_batch(session)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # After the last test using the shared Ray (and its fixtures' teardown): its processes would only take
    # CPU from the tests after it.
    if item.nodeid == item.config.stash.get(ray_local.LAST_USER, None):
        ray_local.stop_shared_ray(item.config)


@pytest.fixture(scope="session")
def shared_ray(request: pytest.FixtureRequest) -> Iterator[ray_local.LocalRay]:
    """The session's local Ray (2 CPUs): `shared_ray.start()` attaches this process and returns the GCS
    address for subprocess drivers (tests/support/ray_local.py)."""
    local = request.config.stash.setdefault(ray_local.SHARED, ray_local.LocalRay())
    yield local
    local.stop()


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
