"""DEEPINFER_CPU_KV_CACHE_GIB sizes the CPU KV cache of the engines the pipeline builds (the test suite sets
it small in tests/conftest.py: zeroing the default 1 GiB took most of each tiny-model submit's engine
start)."""

from __future__ import annotations

import pytest
from deepinfer.pipeline.stages.generate import CPU_KV_CACHE_ENV, _build_llm

KWARGS = {"device": "cpu", "dtype": "float32"}


@pytest.mark.parametrize("gib", ["0.01", "0.03"])
def test_the_variable_sets_the_cpu_kv_cache_size(model_dir, monkeypatch, gib) -> None:
    monkeypatch.setenv(CPU_KV_CACHE_ENV, gib)
    llm = _build_llm(model_dir, KWARGS)
    assert llm.cache_cfg.num_blocks == int(float(gib) * (1 << 30)) // llm.kv_cache_spec.bytes_per_block


def test_a_bad_value_names_the_variable(model_dir, monkeypatch) -> None:
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "a lot")
    with pytest.raises(ValueError, match=f"{CPU_KV_CACHE_ENV}='a lot': expected a number of GiB"):
        _build_llm(model_dir, KWARGS)
