"""`deepinfer-job` usage: validate exits 0/2 naming fields and stays light (no torch/ray); exit codes;
--help has examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deepinfer.pipeline.cli.main import main

REPO = Path(__file__).resolve().parents[2]
LABELING = REPO / "jobs" / "labeling.yaml"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_validate_good_spec_exits_0() -> None:
    proc = run_cli("validate", str(LABELING))
    assert proc.returncode == 0, proc.stderr
    assert "valid job spec" in proc.stdout


def test_validate_bad_spec_exits_2_naming_the_field_without_traceback() -> None:
    proc = run_cli("validate", str(LABELING), "--set", "sampling.temperature=-1", "--set", "runtime.bogus=1")
    assert proc.returncode == 2
    assert "sampling.temperature: -1 is less than the minimum of 0" in proc.stderr
    assert "runtime.bogus: unknown field" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_validate_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys; from deepinfer.pipeline.cli.main import main; rc = main(['validate', sys.argv[1]]); "
        "heavy = [m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules]; "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(LABELING)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def _write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


BASE = {"model": {"name": "demo"}, "input": {"path": "in.jsonl", "format": "jsonl"},
        "prompt": {"template": "{{ text }}"}, "output": {"path": "out"}}

BAD_CASES = [
    ("unknown key", {**BASE, "sampler": {}}, "sampler: unknown field"),
    ("wrong type", {**BASE, "runtime": {"batch_size": "big"}}, "runtime.batch_size: 'big' is not of type"),
    ("out of range", {**BASE, "sampling": {"top_p": 0}}, "sampling.top_p: 0 is less than or equal to"),
    ("invalid output_schema", {**BASE, "output_schema": {"type": 5}}, "output_schema.type: not a valid JSON"),
    ("unsupported output_schema", {**BASE, "output_schema": {"type": "array", "uniqueItems": True}},
     "output_schema: not supported by constrained decoding"),
    ("missing input path", {**BASE, "input": {"format": "jsonl"}}, "input.path: required field is missing"),
    ("missing section", {k: v for k, v in BASE.items() if k != "prompt"},
     "prompt: required field is missing"),
]


@pytest.mark.parametrize(("what", "doc", "expected"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_validate_rejects_bad_specs_with_exit_2(tmp_path: Path, capsys, what, doc, expected) -> None:
    assert main(["validate", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["validate", "{spec}", "--set", "sampling.seed"], "expected KEY=VALUE"),
    (["validate", "{spec}", "--set", "prompt.template.x=1"], "prompt.template is a str, not a mapping"),
    (["validate", "{dir}/nope.yaml"], "no such spec file"),
])
def test_bad_usage_exits_2(tmp_path: Path, capsys, argv, expected) -> None:
    spec = _write(tmp_path, BASE)
    argv = [a.format(spec=spec, dir=tmp_path) for a in argv]
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_unknown_command_and_missing_argument_exit_2(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert main(["submit"]) == 2
    assert main([]) == 2


def test_set_overrides_reach_the_resolved_spec(tmp_path: Path, capsys) -> None:
    spec = _write(tmp_path, BASE)
    rc = main(["validate", spec, "--print", "--set", "sampling.seed=42", "--set", "output.path=/data/run-7",
               "--set", "runtime.engines=3"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sampling"]["seed"] == 42 and doc["runtime"]["engines"] == 3
    assert doc["output"]["path"] == "/data/run-7"
    assert doc["input"]["path"] == str(tmp_path / "in.jsonl")


@pytest.mark.parametrize("command", [[], ["validate"], ["submit"], ["status"]])
def test_help_shows_examples(capsys, command) -> None:
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "example" in out and "deepinfer-job" in out


def _exit_code_cases():
    from deepinfer.pipeline.errors import (
        ErrorBudgetExceeded,
        FingerprintMismatch,
        RetryableStorageError,
        SpecError,
    )

    return [
        ("spec error", SpecError(["a.b: bad"]), 2),
        ("error budget", ErrorBudgetExceeded(5, 10, 0.1), 3),
        ("another job", FingerprintMismatch("/out", ["sampling: seed 1 -> 2"]), 4),
        ("storage", RetryableStorageError("s3 timed out"), 75),
        ("os error", ConnectionResetError("reset by peer"), 75),
        ("wrapped cause", RuntimeError("task failed"), 1),
        ("bug", KeyError("oops"), 1),
    ]


@pytest.mark.parametrize("case", range(7))
def test_exceptions_map_to_the_contract_exit_codes(case) -> None:
    from deepinfer.pipeline.errors import classify_exception

    what, exc, code = _exit_code_cases()[case]
    assert classify_exception(exc)[0] == code, what


def test_retryable_cause_inside_a_wrapper_exits_75() -> None:
    from deepinfer.pipeline.errors import classify_exception

    try:
        try:
            raise TimeoutError("read timed out")
        except TimeoutError as inner:
            raise RuntimeError("stage failed") from inner
    except RuntimeError as exc:
        assert classify_exception(exc)[0] == 75


@pytest.mark.parametrize("verbose", [False, True])
def test_unexpected_exception_exits_1_with_traceback_only_when_verbose(monkeypatch, capsys, verbose) -> None:
    import deepinfer.pipeline.cli.main as cli

    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "cmd_submit", boom)
    assert main(["submit", str(LABELING), *(["-v"] if verbose else [])]) == 1
    err = capsys.readouterr().err
    assert "unexpected error: KeyError" in err
    assert ("Traceback" in err) == verbose
