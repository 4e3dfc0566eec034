"""User mistakes an outside audit found handled wrongly (2026-12-05), each now a clear exit-2 error naming
what is wrong and where, before any work is done:

- an input or output URL scheme deepinfer has no storage for (was: exit 1 "bug", or exit 75 "run again");
- a Parquet file declared as JSONL (was: its pages quarantined as rows of garbage, exit 3);
- a `--summary-json` path that cannot be written (was: found after the whole job ran, leaving _SUCCESS and
  _FAILED side by side);
- a kept column, eval reference or group column that no input row has (was: written as nulls, exit 0);
- an eval metric that is no metric, or a typo inside a metric's object form (was: "is not valid under any
  of the given schemas");
- a model directory without, or with a broken, config.json, and a model.path naming a file.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.errors import ExitCode, InputError, SpecError
from deepinfer.pipeline.spec.load import load_spec

from tests.support.pipeline_helpers import review_rows, write_jsonl, write_spec


def _doc(model_dir: str, input_path: Path, out: Path, **changes) -> dict:
    doc = {
        "model": {"path": model_dir},
        "input": {"path": str(input_path), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ text }}\nTopic:"},
        "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 3},
        "output": {"path": str(out), "format": "jsonl", "keep_columns": ["topic"]},
        "runtime": {"executor": "local", "rows_per_part": 4},
    }
    for section, values in changes.items():
        doc[section] = {**doc.get(section, {}), **values}
    return doc


@pytest.fixture
def reviews(tmp_path) -> Path:
    write_jsonl(tmp_path / "in" / "reviews.jsonl", review_rows(6))
    return tmp_path / "in" / "reviews.jsonl"


# (field, value, accepted)
SCHEMES = [
    ("input.path", "foo://bucket/x.jsonl", False),
    ("input.path", "ftp://host/x.jsonl", False),
    ("input.path", "http://localhost:1/x.jsonl", False),
    ("input.path", "s3://bucket/x.jsonl", True),
    ("output.path", "gs://bucket/out", False),
    ("output.path", "memory://out", False),
    ("output.path", "s3a://bucket/out", True),
    ("output.path", "file:///tmp/deepinfer-out", True),
]


@pytest.mark.parametrize("field,value,accepted", SCHEMES)
def test_a_url_scheme_without_storage_is_refused_by_validate(tmp_path, reviews, field, value, accepted):
    spec = write_spec(tmp_path / "s.yaml", _doc("demo", reviews, tmp_path / "out"))
    overrides = [f"{field}={value}"]
    if accepted:
        load_spec(spec, overrides)
        return
    with pytest.raises(SpecError, match=f"{field}: .* which deepinfer cannot read or write"):
        load_spec(spec, overrides)


def test_a_parquet_file_declared_as_jsonl_is_a_bad_file(tmp_path):
    from deepinfer.pipeline.stages.read import list_input

    path = tmp_path / "rows.jsonl"
    pq.write_table(pa.table({"rid": ["a", "b"], "text": ["x", "y"]}), path)
    with pytest.raises(InputError, match="it is a Parquet file \\(set input.format: parquet\\)"):
        list_input(str(path), "jsonl")
    (listed,) = list_input(str(path), "jsonl", on_bad_file="quarantine")
    assert "Parquet file" in listed.bad


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_an_unwritable_summary_path_fails_before_the_job_runs(model_dir, tmp_path, reviews, capsys, where):
    spec = write_spec(tmp_path / "s.yaml", _doc(model_dir, reviews, tmp_path / "out"))
    target = tmp_path / "nope" / "s.json" if where == "missing-dir" else tmp_path
    assert main(["submit", spec, "--summary-json", str(target)]) == ExitCode.USAGE
    assert f"--summary-json {target}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# (section changes, the field the error names)
ABSENT = [
    ({"output": {"keep_columns": ["topik"]}}, "output.keep_columns"),
    ({"eval": {"reference_column": "answr", "metrics": ["exact_match"]}}, "eval.reference_column"),
    ({"eval": {"reference_column": "topic", "metrics": ["contains"], "group_by": "grup"}}, "eval.group_by"),
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("changes,field", ABSENT)
def test_a_column_no_input_row_has_is_refused(model_dir, tmp_path, capsys, fmt, changes, field):
    rows = review_rows(6)
    if fmt == "jsonl":
        write_jsonl(tmp_path / "in" / "r.jsonl", rows)
    else:
        (tmp_path / "in").mkdir()
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "r.parquet")
    doc = _doc(model_dir, tmp_path / "in", tmp_path / "out", input={"format": fmt}, **changes)
    spec = write_spec(tmp_path / "s.yaml", doc)
    assert main(["submit", spec]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert f"{field}: no input row has a column" in err
    assert not list((tmp_path / "out").glob("parts/*"))


def test_absent_columns_reads_keys_not_values(tmp_path):
    from deepinfer.pipeline.stages.assemble import absent_columns
    from deepinfer.pipeline.stages.read import list_input

    write_jsonl(tmp_path / "a.jsonl", [{"rid": "1", "note": None}, {"rid": "2", "extra": 1}])
    listing = list_input(str(tmp_path / "a.jsonl"), "jsonl")
    # A key present with null values is a column (sparse data); a key no row has is not.
    assert absent_columns(listing, "jsonl", ["note", "extra", "nothing"], None) == ["nothing"]
    (tmp_path / "empty.jsonl").write_text("")
    empty = list_input(str(tmp_path / "empty.jsonl"), "jsonl")
    assert absent_columns(empty, "jsonl", ["nothing"], None) == []   # no rows: nothing to refuse


# (metrics, expected message)
METRICS = [
    (["bleu"], "eval.metrics.0: 'bleu' is not one of ['exact_match', 'contains', 'choice_loglikelihood'] "
               "(or the object form {metric, pattern, field, name})"),
    ([{"metric": "regex_match", "patern": "x"}], "eval.metrics.0.patern: unknown field (allowed here: field, "
                                                 "metric, name, pattern)"),
    ([{"metric": "bleu"}], "eval.metrics.0.metric: 'bleu' is not one of"),
]


@pytest.mark.parametrize("metrics,message", METRICS)
def test_a_wrong_metric_says_which_forms_there_are(tmp_path, reviews, metrics, message):
    doc = _doc("demo", reviews, tmp_path / "out", eval={"reference_column": "topic", "metrics": metrics})
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path / "s.yaml", doc), [])
    assert message in str(err.value)


@pytest.mark.parametrize("content,message", [(None, "has no config.json"),
                                             ("{", "config.json is not valid JSON"),
                                             ("[1]", "must hold a JSON object")])
def test_a_models_config_file_is_named_when_it_is_missing_or_broken(tmp_path, content, message):
    from deepinfer.pipeline.stages.prompt import model_max_len

    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(SpecError, match=message):
        model_max_len(tmp_path, None)


def test_a_model_path_naming_a_file_says_so(tmp_path):
    from deepinfer.engine.models.loader import resolve_model_dir

    (tmp_path / "model.yaml").write_text("x")
    with pytest.raises(ValueError, match="a file, not a directory"):
        resolve_model_dir(str(tmp_path / "model.yaml"))
