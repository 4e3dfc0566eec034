"""Job fingerprints (pipeline/fingerprint.py): content decides, and differences are explained."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from deepinfer.pipeline.output.fingerprint import (
    describe_inputs,
    diff_fingerprints,
    job_fingerprint,
    safetensors_digest,
)
from deepinfer.pipeline.output.storage import open_fs
from safetensors.numpy import save_file

SPEC = {
    "name": "labeling",
    "model": {"path": "/models/tiny", "dtype": "float32", "max_model_len": 256},
    "input": {"path": "/data/in", "format": "jsonl", "id_column": "id"},
    "prompt": {"mode": "raw", "template": "Label: {{ text }}"},
    "sampling": {"temperature": 0.0, "max_tokens": 8, "seed": 1},
    "output_schema": {"type": "object", "properties": {"label": {"type": "string"}}},
    "output": {"path": "/data/out", "format": "parquet", "keep_columns": ["text"]},
    "runtime": {"executor": "local", "engines": 1, "rows_per_part": 100, "max_error_fraction": 0.01,
                "max_num_seqs": 32},
}


def _model(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((64, 64)).astype(np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


@pytest.fixture
def setup(tmp_path):
    model = _model(tmp_path / "model")
    data = tmp_path / "in"
    data.mkdir()
    for name, text in [("a.jsonl", '{"id": 1, "text": "x"}\n'), ("b.jsonl", '{"id": 2, "text": "y"}\n')]:
        (data / name).write_text(text)
    fs, root = open_fs(str(data))
    listing = describe_inputs(fs, [f"{root}/a.jsonl", f"{root}/b.jsonl"], root)
    return model, data, listing


def _with(spec: dict, dotted: str, value) -> dict:
    spec = copy.deepcopy(spec)
    *head, last = dotted.split(".")
    node = spec
    for key in head:
        node = node[key]
    node[last] = value
    return spec


def test_fingerprint_is_deterministic_and_json_serializable(setup):
    model, _, listing = setup
    a = job_fingerprint(SPEC, str(model), listing)
    assert a == job_fingerprint(copy.deepcopy(SPEC), str(model), list(reversed(listing)))
    assert json.loads(json.dumps(a)) == a and diff_fingerprints(a, a) == []
    assert [e["path"] for e in listing] == ["a.jsonl", "b.jsonl"]
    assert all(e["checksum"].startswith("sha256:") for e in listing)


@pytest.mark.parametrize(
    "dotted, value, expected",
    [
        ("sampling.seed", 2, "sampling: seed: 1 -> 2"),
        ("sampling.temperature", 0.7, "sampling: temperature: 0.0 -> 0.7"),
        ("prompt.template", "Tag: {{ text }}", "prompt template: template:"),
        ("output_schema", {"type": "object"}, "output_schema: properties removed"),
        ("output.format", "jsonl", 'output: format: "parquet" -> "jsonl"'),
        ("output.keep_columns", [], "output: keep_columns"),
        ("input.id_column", "key", "input: id_column"),
        ("model.dtype", "bfloat16", "model: dtype"),
        ("model.max_model_len", 128, "model: max_model_len"),
    ],
)
def test_each_semantic_change_is_detected_and_named(setup, dotted, value, expected):
    model, _, listing = setup
    diffs = diff_fingerprints(job_fingerprint(SPEC, str(model), listing),
                              job_fingerprint(_with(SPEC, dotted, value), str(model), listing))
    assert len(diffs) == 1 and diffs[0].startswith(expected), diffs


@pytest.mark.parametrize(
    "dotted, value",
    [
        ("runtime.engines", 4),
        ("runtime.max_num_seqs", 8),
        ("runtime.max_error_fraction", 0.5),
        ("runtime.rows_per_part", 50),  # a resume keeps the stored part plan (x-affects-output: false)
        ("runtime.sort_window", 7),
        ("output.path", "s3://bucket/elsewhere"),
        ("input.path", "/mnt/copy/in"),
        ("model.path", "/other/copy/of/tiny"),
        ("input.storage_options", {"key": "SECRET"}),
    ],
)
def test_changes_that_cannot_change_output_bytes_keep_the_fingerprint(setup, dotted, value):
    model, _, listing = setup
    changed = job_fingerprint(_with(SPEC, dotted, value), str(model), listing)
    assert changed == job_fingerprint(SPEC, str(model), listing)
    assert "SECRET" not in json.dumps(changed)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m: (m / "config.json").write_text('{"hidden_size": 32}'), "model: config.json changed"),
        (lambda m: _model(m, seed=1), "model: model.safetensors changed"),  # same header, other weights
        (lambda m: (m / "tokenizer.json").write_text("{}"), "tokenizer: tokenizer.json changed"),
        (lambda m: (m / "chat_template.jinja").write_text("{{ x }}"), "tokenizer: chat_template.jinja added"),
    ],
)
def test_model_and_tokenizer_content_changes_are_detected(tmp_path, setup, change, expected):
    model, _, listing = setup
    before = job_fingerprint(SPEC, str(model), listing)
    moved = tmp_path / "moved-model"
    shutil.copytree(model, moved)
    assert job_fingerprint(SPEC, str(moved), listing) == before  # where it lives does not matter
    change(moved)
    assert diff_fingerprints(before, job_fingerprint(SPEC, str(moved), listing)) == [expected]


def test_input_changes_list_the_files(setup):
    model, data, listing = setup
    before = job_fingerprint(SPEC, str(model), listing)
    (data / "b.jsonl").write_text('{"id": 2, "text": "z"}\n')
    (data / "c.jsonl").write_text('{"id": 3, "text": "w"}\n')
    fs, root = open_fs(str(data))
    after = describe_inputs(fs, [f"{root}/{n}" for n in ("a.jsonl", "b.jsonl", "c.jsonl")], root)
    diffs = diff_fingerprints(before, job_fingerprint(SPEC, str(model), after))
    assert diffs == ["input: 1 file(s) added: c.jsonl; 1 file(s) changed: b.jsonl"]


def test_safetensors_digest_reads_header_and_samples(tmp_path):
    first, again = _model(tmp_path / "m1"), _model(tmp_path / "m2")  # same tensors written twice
    digest = safetensors_digest(str(first / "model.safetensors"))
    assert digest == safetensors_digest(str(again / "model.safetensors"))
    save_file({"w": np.zeros((64, 32), np.float32)}, str(again / "model.safetensors"))
    assert safetensors_digest(str(again / "model.safetensors")) != digest
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_digest(str(bad))


def test_model_dir_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no weights"):
        job_fingerprint(SPEC, str(tmp_path), [])
