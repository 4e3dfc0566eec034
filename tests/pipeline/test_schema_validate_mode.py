"""output_schema_mode: validate — generation constrained by the enforceable part of the schema, every answer
validated against the whole schema afterwards: answers that break the unenforceable keyword (`contains`)
are quarantined with SCHEMA_VIOLATION and never committed. The default, strict, refuses the schema at
validate time naming the keyword.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.spec.enforceable import enforceable_part
from deepinfer.pipeline.spec.load import JobSpec, SpecError

from tests.support.pipeline_helpers import read_parts, write_jsonl, write_spec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tags"],
          "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                  "maxItems": 2, "contains": {"const": "c"}}}}


def _doc(tmp_path: Path, model: dict, mode: str | None) -> dict:
    doc = {"model": model, "input": {"path": str(tmp_path / "in" / "r.jsonl"), "format": "jsonl",
                                     "id_column": "rid"},
           "prompt": {"mode": "raw", "template": "Tag {{ x }}:"},
           "sampling": {"temperature": 1.0, "max_tokens": 40, "seed": 1},
           "output_schema": SCHEMA, "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
           "runtime": {"executor": "local", "max_error_fraction": 1.0}}
    if mode is not None:
        doc["output_schema_mode"] = mode
    return doc


def test_enforceable_part_drops_only_the_unenforceable_keyword() -> None:
    grammar, dropped, problems = enforceable_part(SCHEMA)
    assert dropped == ["contains"] and problems == []
    assert "contains" not in grammar["properties"]["tags"] and grammar["properties"]["tags"]["maxItems"] == 2
    named = {"type": "object", "properties": {"not": {"type": "integer", "not": {"const": 3}}}}
    grammar, dropped, _ = enforceable_part(named)
    assert dropped == ["not"] and grammar == {"type": "object", "properties": {"not": {"type": "integer"}}}


def test_strict_mode_refuses_naming_the_keyword(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        JobSpec.from_document(_doc(tmp_path, {"name": "demo"}, None))
    assert any(p.startswith("output_schema: not supported by constrained decoding") and "contains" in p
               and "output_schema_mode: validate" in p for p in info.value.problems), info.value.problems
    spec = JobSpec.from_document(_doc(tmp_path, {"name": "demo"}, "validate"))
    assert spec.output_schema_mode == "validate"


def test_validate_mode_quarantines_violations_never_commits_them(model_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in" / "r.jsonl", [{"rid": f"r{i:02d}", "x": i} for i in range(16)])
    spec = write_spec(tmp_path / "spec.yaml", _doc(tmp_path, {"path": model_dir}, "validate"))
    assert main(["submit", spec]) == 0
    parts = read_parts(tmp_path / "out")
    committed = parts.to_pylist() if parts is not None else []
    errors = read_parts(tmp_path / "out", "errors").to_pylist()
    assert len(committed) + len(errors) == 16 and committed  # some answers do contain "c"
    for row in committed:  # everything committed satisfies the whole schema, `contains` included
        jsonschema.validate(json.loads(row["json"]), SCHEMA)
        assert "c" in row["tags"]
    violations = [e for e in errors if e["code"] == "SCHEMA_VIOLATION"]
    assert violations, "the tiny model should break `contains` at least once at temperature 1.0"
    assert {e["code"] for e in errors} <= {"SCHEMA_VIOLATION", "TRUNCATED"}
    for e in violations:
        assert e["stage"] == "validate" and "contain" in e["message"]
        assert e["id"] not in {r["rid"] for r in committed}


def test_schema_mode_is_in_the_fingerprint_only_when_not_default(tmp_path: Path) -> None:
    from deepinfer.pipeline.output.fingerprint import diff_fingerprints, job_fingerprint

    doc = _doc(tmp_path, {"name": "demo"}, "validate")
    doc["output_schema"] = {"type": "object"}
    prints = {}
    for mode in ("strict", "validate"):
        spec = JobSpec.from_document({**doc, "output_schema_mode": mode})
        prints[mode] = job_fingerprint(spec.document, None, [])
    assert "schema_mode" not in prints["strict"] and "schema_mode" in prints["validate"]
    assert any("output_schema_mode" in d for d in diff_fingerprints(prints["strict"], prints["validate"]))
