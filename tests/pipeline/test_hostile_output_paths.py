"""Output paths are owned, secrets never reach _job.json, refused specs leave nothing behind (defects 2,
3, 9), and bad input files are never skipped silently.

deepinfer writes only into a new or empty directory or one holding its own job; --restart deletes only
what the output's manifest lists; `/`, `s3://` and the input's own tree are refused at validate; a spec
refused at submit writes no `_job.json`, so fixing it and submitting to the same path works; a resume
may change runtime.rows_per_part.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.errors import OutputPathError
from deepinfer.pipeline.output.commit import OutputStore
from deepinfer.pipeline.spec.load import redact

from tests.support import commit_harness as h
from tests.support.pipeline_helpers import output_digest, read_parts, review_rows, write_jsonl, write_spec

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def _spec(tmp_path: Path, model: str, **sections) -> dict:
    doc = {"model": {"path": model},
           "input": {"path": str(tmp_path / "in.jsonl"), "format": "jsonl", "id_column": "rid"},
           "prompt": {"mode": "raw", "template": "{{ text }}"}, "sampling": {"max_tokens": 2},
           "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
           "runtime": {"executor": "local", "rows_per_part": 2}}
    for name, value in sections.items():
        doc[name] = {**doc.get(name, {}), **value}
    return doc


@pytest.fixture()
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.mark.parametrize("output, input_, expected", [
    ("/", "{t}/in.jsonl", "is a filesystem root"),
    ("s3://", "{t}/in.jsonl", "whole s3:// store"),
    ("{t}/data/out", "{t}/data", "inside the input's directory tree"),
    ("{t}/data/sub/out", "{t}/data/*.jsonl", "inside the input's directory tree"),
    ("{t}", "{t}/data", "contains the input"),
    ("s3://b/in/out", "s3://b/in/*.jsonl", "inside the input's directory tree"),
])
def test_validate_refuses_roots_and_overlap_with_the_input(tmp_path, capsys, output, input_, expected):
    (tmp_path / "data").mkdir()
    doc = _spec(tmp_path, "/models/x", input={"path": input_.format(t=tmp_path)},
                output={"path": output.format(t=tmp_path)})
    assert main(["validate", write_spec(tmp_path / "job.yaml", doc)]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("options, expected", [
    ({"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": SECRET}},
     "SSECustomerKey"),
    ({"SecretAccessKey": SECRET}, "SecretAccessKey: credentials do not belong"),
    ({"client_kwargs": {"endpoint_url": "http://user:pass@minio:9000"}}, "user:password@"),
    ({"config_kwargs": {"proxies": {"https": "http://p"}}}, "not an allowed storage option"),
    ({"key": SECRET}, "credentials do not belong"),
])
def test_secrets_in_storage_options_are_refused_and_never_written(tmp_path, capsys, model, options, expected):
    write_jsonl(tmp_path / "in.jsonl", review_rows(2))
    spec = write_spec(tmp_path / "job.yaml", _spec(tmp_path, model, output={"storage_options": options}))
    assert main(["validate", spec]) == 2
    err = capsys.readouterr().err
    assert expected in err and SECRET not in err and "pass@" not in err
    assert main(["submit", spec]) == 2
    assert not (tmp_path / "out").exists()
    record = json.dumps(redact({"output": {"storage_options": options}}))  # what _job.json would hold
    assert SECRET not in record and "pass@" not in record


def test_allowed_storage_options_pass() -> None:
    from deepinfer.pipeline.spec.secrets import storage_option_problems

    ok = {"endpoint_url": "https://s3.eu-west-1.amazonaws.com", "client_kwargs": {"region_name": "eu-west-1"},
          "config_kwargs": {"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 5},
                            "connect_timeout": 5},
          "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms"}}
    assert storage_option_problems(ok, "output.storage_options") == []
    assert redact({"storage_options": ok}) == {"storage_options": ok}


def test_a_foreign_directory_is_refused_even_with_restart(tmp_path: Path) -> None:
    target = tmp_path / "etc"
    (target / "parts").mkdir(parents=True)
    (target / "passwd").write_text("root:x:0:0\n")
    (target / "parts" / "mine.txt").write_text("keep me\n")
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    for restart in (False, True):
        with pytest.raises(OutputPathError, match=r"holds no deepinfer job \(parts/mine.txt, passwd\)"):
            h.run(str(target), restart=restart)
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before


def test_restart_deletes_only_what_the_manifest_lists(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    h.run(url, seed=0)
    victim = tmp_path / "victim.txt"
    victim.write_text("outside the output\n")
    user_files = ["README.md", "parts/notes.txt", "errors/keep.me", "_commits/hand.txt"]
    for rel in user_files:
        (tmp_path / "out" / rel).write_text("the user's\n")
    marker = sorted((tmp_path / "out" / "_commits").glob("*.json"))[0]
    record = json.loads(marker.read_text())
    record["objects"].append({"kind": "parts", "path": "../victim.txt", "rows": 0, "bytes": 0, "sha256": ""})
    marker.write_text(json.dumps(record))  # a hand-edited marker cannot aim --restart outside
    assert h.run(url, seed=1, restart=True)["committed"] == 11
    assert victim.exists() and all((tmp_path / "out" / rel).exists() for rel in user_files)
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["summary"]["seed"] == 1


def test_job_record_of_a_refused_run_is_taken_back(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    parts, record = h.job(seed=0)
    with OutputStore(url) as store:
        store.begin(record)
        assert store.discard_if_unstarted()  # e.g. the engine refused the model settings
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) in ([], ["_runs"])
    assert h.run(url, seed=1)["committed"] == 11  # the fixed spec is another job: no exit 4


def test_refused_model_then_fixed_spec_works_on_the_same_output(tmp_path: Path, model, capsys) -> None:
    write_jsonl(tmp_path / "in.jsonl", review_rows(4))
    pickled = tmp_path / "pickled-model"
    shutil.copytree(model, pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    spec = write_spec(tmp_path / "job.yaml", _spec(tmp_path, str(pickled)))
    assert main(["submit", spec]) == 2
    assert "pickle" in capsys.readouterr().err
    assert not (tmp_path / "out" / "_job.json").exists()
    assert main(["submit", spec, "--set", f"model.path={model}"]) == 0


def test_resume_may_change_rows_per_part(tmp_path: Path, model) -> None:
    write_jsonl(tmp_path / "in.jsonl", review_rows(6))
    spec = write_spec(tmp_path / "job.yaml", _spec(tmp_path, model))
    out = tmp_path / "out"
    assert main(["submit", spec]) == 0
    full = output_digest(out)
    for marker in sorted((out / "_commits").glob("*.json"))[1:]:  # as if killed after one commit
        for obj in json.loads(marker.read_text())["objects"]:
            (out / obj["path"]).unlink()
        marker.unlink()
    (out / "_SUCCESS").unlink()
    assert main(["submit", spec, "--set", "runtime.rows_per_part=5"]) == 0
    assert output_digest(out) == full


def test_bad_input_file_fails_naming_it_or_is_quarantined(tmp_path: Path, model, capsys) -> None:
    data = tmp_path / "pq"
    data.mkdir()
    pq.write_table(pa.table({"rid": ["a", "b", "c"], "text": ["x", "y", "z"]}), data / "a.parquet")
    (data / "b.parquet").write_bytes(b"PAR1 truncated")
    doc = _spec(tmp_path, model, input={"path": str(data), "format": "parquet"},
                runtime={"max_error_fraction": 0.5})
    spec = write_spec(tmp_path / "job.yaml", doc)
    assert main(["submit", spec]) == 2
    err = capsys.readouterr().err
    assert str(data / "b.parquet") in err and "on_bad_file" in err
    assert not (tmp_path / "out" / "_job.json").exists()
    assert main(["submit", spec, "--set", "input.on_bad_file=quarantine"]) == 0
    errors = read_parts(tmp_path / "out", "errors")
    assert errors.column("code").to_pylist() == ["BAD_FILE"]
    assert errors.column("id").to_pylist() == ["b.parquet:0"]
    assert "b.parquet" in errors.column("message")[0].as_py()
    assert read_parts(tmp_path / "out").column("rid").to_pylist() == ["a", "b", "c"]
