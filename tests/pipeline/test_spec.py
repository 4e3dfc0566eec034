"""Job spec loading: defaults, path resolution, --set overrides, and bad specs naming their field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from deepinfer.pipeline.spec.load import JobSpec, apply_override, load_document, load_spec
from deepinfer.pipeline.spec.schema import SpecError, load_schema

GOOD = {
    "model": {"name": "demo"},
    "input": {"path": "data/in.jsonl", "format": "jsonl", "id_column": "id"},
    "prompt": {"template": "Classify: {{ text }}"},
    "output": {"path": "out"},
}


def write_spec(tmp_path: Path, doc: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def with_change(path: str, value) -> dict:
    """GOOD with the field at dotted `path` set to `value` (or removed when value is DELETE)."""
    doc = copy.deepcopy(GOOD)
    keys = path.split(".")
    node = doc
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


DELETE = object()

BAD_SPECS = [
    # (description, dotted field to change, value, text the error must contain)
    ("unknown top-level key", "extra", 1, "extra: unknown field"),
    ("unknown nested key", "sampling.temprature", 0.5, "sampling.temprature: unknown field"),
    ("wrong type", "sampling.max_tokens", "many", "sampling.max_tokens: 'many' is not of type 'integer'"),
    ("negative temperature", "sampling.temperature", -1,
     "sampling.temperature: -1 is less than the minimum of 0"),
    ("top_p above 1", "sampling.top_p", 1.5, "sampling.top_p: 1.5 is greater than the maximum of 1"),
    ("top_k zero", "sampling.top_k", 0, "sampling.top_k: 0 is not allowed"),
    ("bad format", "input.format", "csv",
     "input.format: 'csv' is not one of ['parquet', 'jsonl', 'openai_batch']"),
    ("missing input path", "input.path", DELETE, "input.path: required field is missing"),
    ("missing prompt template", "prompt.template", DELETE, "prompt.template: required field is missing"),
    ("missing output section", "output", DELETE, "output: required field is missing"),
    ("error fraction above 1", "runtime.max_error_fraction", 2, "runtime.max_error_fraction: 2 is greater"),
    ("zero engines", "runtime.engines", 0, "runtime.engines: 0 is less than the minimum of 1"),
    ("unknown executor", "runtime.executor", "spark", "runtime.executor: 'spark' is not one of"),
    ("invalid output_schema", "output_schema", {"type": "objekt"},
     "output_schema.type: not a valid JSON Schema"),
    ("output_schema not a mapping", "output_schema", [1],
     "output_schema: [1] is not of type 'object', 'null'"),
    ("schema property clashes", "output_schema",
     {"type": "object", "properties": {"text": {"type": "string"}}},
     "output_schema.properties.text: clashes with output column 'text'"),
    ("kept column clashes", "output.keep_columns", ["seed"], "output.keep_columns: 'seed' clashes"),
    ("both model name and path", "model.path", "/models/x", "model: give exactly one of model.name"),
    ("no model", "model.name", DELETE, "model: give exactly one of model.name"),
    ("template syntax", "prompt.template", "{{ text ", "prompt.template: template syntax error on line 1"),
    ("system in raw mode", "prompt", {"template": "x", "mode": "raw", "system": "s"},
     "prompt.system: only used"),
    ("bad chat date", "prompt.chat_date", "yesterday", "prompt.chat_date: 'yesterday' does not match"),
    ("output equals input", "output.path", "data/in.jsonl", "output.path: must differ from input.path"),
    ("credentials in storage_options", "output.storage_options",
     {"client_kwargs": {"aws_secret_access_key": "x"}},
     "output.storage_options.client_kwargs.aws_secret_access_key: credentials do not belong in a job spec"),
]


@pytest.mark.parametrize(("what", "field", "value", "expected"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_rejected_naming_the_field(tmp_path: Path, what, field, value, expected) -> None:
    path = write_spec(tmp_path, with_change(field, value))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert any(expected in p for p in info.value.problems), info.value.problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    doc = with_change("sampling", {"temperature": -1, "max_tokens": 0, "nope": 1})
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, doc))
    fields = sorted(p.split(":")[0] for p in info.value.problems)
    assert fields == ["sampling.max_tokens", "sampling.nope", "sampling.temperature"]


def test_defaults_are_filled_from_the_schema(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, GOOD))
    assert spec.sampling.temperature == 1.0 and spec.sampling.seed == 0 and spec.sampling.max_tokens == 256
    assert spec.runtime.executor == "auto" and spec.runtime.max_error_fraction == 0.01
    assert spec.runtime.rows_per_part == 1000 and spec.output.format == "parquet"
    assert spec.prompt.mode == "chat" and spec.output_schema is None
    assert spec.document["runtime"]["batch_size"] == spec.runtime.batch_size


def test_relative_paths_resolve_against_the_spec_file(tmp_path: Path, monkeypatch) -> None:
    sub = tmp_path / "jobs"
    sub.mkdir()
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(sub, GOOD))
    assert spec.input.path == str(sub / "data" / "in.jsonl")
    assert spec.output.path == str(sub / "out")


def test_set_paths_resolve_against_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    sub = tmp_path / "jobs"
    sub.mkdir()
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(sub, GOOD), ["output.path=results/run1", "input.path=s3://bucket/in/*.jsonl"])
    assert spec.output.path == str(tmp_path / "results" / "run1")
    assert spec.input.path == "s3://bucket/in/*.jsonl"


@pytest.mark.parametrize(("assignment", "field", "expected"), [
    ("sampling.temperature=0", ("sampling", "temperature"), 0),
    ("sampling.stop=[a, b]", ("sampling", "stop"), ["a", "b"]),
    ("runtime.engines=4", ("runtime", "engines"), 4),
    ("name=my job", ("name",), "my job"),
    ("output.storage_options.client_kwargs.endpoint_url=http://x:1",
     ("output", "storage_options", "client_kwargs", "endpoint_url"), "http://x:1"),
    ("model.max_model_len=null", ("model", "max_model_len"), None),
])
def test_set_overrides_parse_yaml_and_create_mappings(assignment, field, expected) -> None:
    doc = copy.deepcopy(GOOD)
    apply_override(doc, assignment)
    node = doc
    for key in field:
        node = node[key]
    assert node == expected


@pytest.mark.parametrize(("assignment", "expected"), [
    ("sampling.temperature", "expected KEY=VALUE"),
    ("=3", "dotted field path"),
    ("sampling..seed=3", "dotted field path"),
    ("prompt.template.x=1", "prompt.template is a str, not a mapping"),
    ("sampling.stop=[unclosed", "YAML syntax error"),
])
def test_bad_set_is_a_spec_error(assignment, expected) -> None:
    with pytest.raises(SpecError) as info:
        apply_override(copy.deepcopy(GOOD), assignment)
    assert expected in str(info.value)


def test_set_values_are_validated_afterwards(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"sampling.seed: -3 is less than the minimum of 0"):
        load_spec(write_spec(tmp_path, GOOD), ["sampling.seed=-3"])


def test_not_a_mapping_and_bad_yaml_are_spec_errors(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("model: {name: demo\n")
    with pytest.raises(SpecError, match="must be a mapping of sections"):
        load_document(tmp_path / "list.yaml")
    with pytest.raises(SpecError, match="line 2, column 1: YAML syntax error"):
        load_document(tmp_path / "broken.yaml")
    with pytest.raises(SpecError, match="no such spec file"):
        load_document(tmp_path / "missing.yaml")


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}" if path else name)


@pytest.mark.parametrize("name", ["job.schema.json", "summary.schema.json"])
def test_shipped_schemas_are_strict_and_documented(name: str) -> None:
    from jsonschema import Draft202012Validator

    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    for path, sub in _walk(schema):
        if path:
            assert sub.get("description"), f"{name}: {path} has no description"
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False, f"{name}: {path or '(root)'} allows unknown keys"


def test_shipped_job_specs_validate() -> None:
    jobs = Path(__file__).resolve().parents[2] / "jobs"
    specs = sorted(jobs.glob("*.yaml"))
    assert specs, "no example specs in jobs/"
    for path in specs:
        spec = load_spec(path)
        assert isinstance(spec, JobSpec)
        json.dumps(spec.document)  # the resolved document is what _job.json records


@pytest.mark.parametrize("key, secret", [
    ("max_tokens", False), ("stop_token_ids", False), ("endpoint_url", False), ("client_kwargs", False),
    ("token", True), ("aws_session_token", True), ("key", True), ("aws_access_key_id", True),
    ("AWS_SECRET_ACCESS_KEY", True), ("password", True), ("api_key", True),
])
def test_only_credential_names_look_secret(key: str, secret: bool) -> None:
    from deepinfer.pipeline.spec.load import looks_secret, redact

    assert looks_secret(key) is secret
    assert (redact({key: 7})[key] == "<redacted>") is secret
