"""`deepinfer-job verify`: recomputes committed rows of a finished job and compares them field by field.

One tiny job (local executor, raw prompts, 10 rows in 3 parts) is run once per module; each test works on
a copy of its output, so tampering never leaks into another test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.errors import ExitCode

from tests.support.pipeline_helpers import review_rows, write_jsonl, write_spec


def _spec(model_dir: str, input_path: Path, output: Path, fmt: str) -> dict:
    return {
        "model": {"path": model_dir},
        "input": {"path": str(input_path), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ text }}\nTopic:"},
        "sampling": {"temperature": 0.9, "max_tokens": 6, "seed": 11},
        "output": {"path": str(output), "format": fmt, "keep_columns": ["topic"]},
        "runtime": {"executor": "local", "rows_per_part": 4, "batch_size": 3},
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dir) -> dict[str, Path]:
    """fmt -> a finished job output (jsonl and parquet) over the same 10 rows."""
    root = tmp_path_factory.mktemp("verify")
    write_jsonl(root / "in" / "reviews.jsonl", review_rows(10))
    outs = {}
    for fmt in ("jsonl", "parquet"):
        spec = write_spec(root / f"{fmt}.yaml", _spec(model_dir, root / "in", root / f"out-{fmt}", fmt))
        assert main(["submit", spec]) == 0
        outs[fmt] = root / f"out-{fmt}"
    return outs


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_verify_passes_on_a_clean_output(finished, tmp_path, capsys) -> None:
    for fmt, out in finished.items():
        out = _copy(out, tmp_path / fmt)
        assert main(["verify", str(out), "--sample", "100"]) == ExitCode.OK
        printed = capsys.readouterr().out
        assert "10 of 10 committed rows recomputed" in printed and "all byte-identical" in printed


def test_verify_sample_is_a_function_of_the_seed(finished, tmp_path, capsys) -> None:
    out = _copy(finished["jsonl"], tmp_path / "o")
    assert main(["verify", str(out), "--sample", "3", "--seed", "5"]) == ExitCode.OK
    assert "3 of 10 committed rows recomputed (seed 5)" in capsys.readouterr().out


def _tamper_jsonl(out: Path) -> str:
    """Rewrite `text` of the second row of the first part (the file stays valid JSONL); its id."""
    part = sorted((out / "parts").glob("*.jsonl"))[0]
    rows = [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines()]
    rows[1]["text"] = rows[1]["text"] + " tampered"
    part.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return rows[1]["rid"]


def test_verify_fails_with_exit_5_naming_the_row_and_field(finished, tmp_path, capsys) -> None:
    out = _copy(finished["jsonl"], tmp_path / "o")
    rid = _tamper_jsonl(out)
    assert main(["verify", str(out), "--sample", "10"]) == ExitCode.VERIFY_MISMATCH
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("MISMATCH")]
    assert any(f"row {rid!r}" in line and "field 'text'" in line and "tampered" in line for line in lines)
    assert any("does not match the sha256 in its commit marker" in line for line in lines)
    assert "1 of 10 recomputed rows differ" in printed


def test_verify_detects_a_tampered_parquet_part_even_with_its_marker_updated(finished, tmp_path,
                                                                              capsys) -> None:
    import hashlib

    out = _copy(finished["parquet"], tmp_path / "o")
    part = sorted((out / "parts").glob("*.parquet"))[-1]
    table = pq.read_table(part)
    rows = table.to_pylist()
    rows[0]["output_tokens"] += 1
    pq.write_table(table.from_pylist(rows, schema=table.schema), part)
    marker_path = sorted((out / "_commits").glob("*.json"))[-1]
    marker = json.loads(marker_path.read_text())
    for obj in marker["objects"]:  # a forger who also fixes the checksum is still caught by recompute
        if obj["kind"] == "parts":
            obj["sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
    marker_path.write_text(json.dumps(marker))
    assert main(["verify", str(out), "--sample", "10"]) == ExitCode.VERIFY_MISMATCH
    printed = capsys.readouterr().out
    assert f"row {rows[0]['rid']!r}" in printed and "field 'output_tokens'" in printed
    assert "sha256" not in printed


def test_verify_of_a_path_without_a_job_is_exit_2(tmp_path, capsys) -> None:
    assert main(["verify", str(tmp_path), "--sample", "1"]) == ExitCode.USAGE
    assert "holds no deepinfer job" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_verify_names_a_committed_part_that_no_longer_decodes(finished, tmp_path, capsys, fmt) -> None:
    out = _copy(finished[fmt], tmp_path / "o")
    part = sorted((out / "parts").iterdir())[0]
    part.write_bytes(b"\x00garbage" if fmt == "parquet" else b"{not json\n")
    assert main(["verify", str(out), "--sample", "10"]) == ExitCode.VERIFY_MISMATCH
    printed = capsys.readouterr().out
    assert f"parts/{part.name} cannot be read as {fmt}" in printed


@pytest.mark.parametrize("command", ["verify", "status"])
def test_a_damaged_job_record_is_exit_2_naming_it(finished, tmp_path, capsys, command) -> None:
    out = _copy(finished["jsonl"], tmp_path / "o")
    (out / "_job.json").write_text('{"broken')
    assert main([command, str(out)]) == ExitCode.USAGE
    assert "_job.json is not valid JSON: the output was changed outside deepinfer" in capsys.readouterr().err
