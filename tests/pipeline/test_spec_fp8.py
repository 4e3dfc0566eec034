"""Spec keys model.quantization and model.kv_cache_dtype: validated, passed to the engine, fingerprinted."""

from __future__ import annotations

import copy

import pytest
import yaml
from deepinfer.pipeline.spec.load import load_spec
from deepinfer.pipeline.spec.schema import SpecError, load_schema

GOOD = {
    "model": {"name": "demo"},
    "input": {"path": "data/in.jsonl", "format": "jsonl", "id_column": "id"},
    "prompt": {"template": "Classify: {{ text }}"},
    "output": {"path": "out"},
}


def _spec(tmp_path, **model):
    doc = copy.deepcopy(GOOD)
    doc["model"].update(model)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return load_spec(path)


def test_defaults_and_values_reach_engine_kwargs(tmp_path):
    kw = _spec(tmp_path).engine_kwargs()
    assert kw["quantization"] == "auto" and kw["kv_cache_dtype"] == "auto"
    kw = _spec(tmp_path, quantization="fp8", kv_cache_dtype="fp8").engine_kwargs()
    assert kw["quantization"] == "fp8" and kw["kv_cache_dtype"] == "fp8"
    assert _spec(tmp_path, quantization=None).engine_kwargs()["quantization"] is None


@pytest.mark.parametrize("key,value", [("quantization", "int4"), ("kv_cache_dtype", "fp16")])
def test_bad_values_are_refused(tmp_path, key, value):
    with pytest.raises(SpecError):
        _spec(tmp_path, **{key: value})


def test_keys_are_marked_output_affecting():
    props = load_schema()["properties"]["model"]["properties"]
    assert props["quantization"]["x-affects-output"] is True
    assert props["kv_cache_dtype"]["x-affects-output"] is True
