"""Poison rows: each bad row is quarantined exactly once with its code; the error budget decides the exit.

Unit tests of pipeline/errors.py, then `deepinfer-job submit` on a 400-row job (tiny random Llama) in which
5% of the rows are bad in five ways: missing prompt column, null prompt column, a value the template
cannot format, a prompt longer than the model allows, an id of the wrong type.
"""

from __future__ import annotations

import json
import random

import pytest
from deepinfer.pipeline.errors import (
    ERROR_SCHEMA,
    ErrorBudget,
    ErrorBudgetExceeded,
    ErrorRow,
    error_table,
)

from tests.support.cli_harness import cli, reader, snapshot, submit, write_jsonl

# ---- errors.py -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fraction, total, errors, exceeded",
    [
        (0.01, 1000, 10, False),
        (0.01, 1000, 11, True),
        (0.01, 99, 0, False),
        (0.01, 99, 1, True),  # 1% of 99 rows allows no failure
        (0.0, 10, 0, False),
        (0.0, 10, 1, True),
        (1.0, 10, 10, False),
        (0.29, 100, 29, False),  # 0.29 * 100 == 28.999999999999996 in floating point
        (0.07, 100, 8, True),
    ],
)
def test_error_budget_allows_at_most_the_fraction(fraction, total, errors, exceeded):
    budget = ErrorBudget(fraction)
    assert budget.exceeded(errors, total) is exceeded
    if exceeded:
        with pytest.raises(ErrorBudgetExceeded) as info:
            budget.check(errors, total)
        assert info.value.exit_code == 3 and f"{errors} of {total} rows failed" in str(info.value)
    else:
        budget.check(errors, total)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), "0.1", True])
def test_error_budget_rejects_bad_fractions(fraction):
    with pytest.raises(ValueError, match="max_error_fraction"):
        ErrorBudget(fraction)


@pytest.mark.parametrize(
    "args, message",
    [(("r1", "cook", "TEMPLATE_ERROR", "m"), "stage"), (("r1", "prompt", "OOPS", "m"), "code"),
     ((7, "prompt", "TEMPLATE_ERROR", "m"), "id must be a string")],
)
def test_error_row_validates_stage_code_and_id(args, message):
    with pytest.raises(ValueError, match=message):
        ErrorRow(*args)


def test_error_table_has_the_error_schema_and_caps_messages():
    table = error_table([ErrorRow("a", "validate", "SCHEMA_MISMATCH", "x" * 5000)])
    assert table.schema.equals(ERROR_SCHEMA) and len(table.column("message")[0].as_py()) == 2000
    assert error_table([]).num_rows == 0 and error_table([]).schema.equals(ERROR_SCHEMA)


# ---- end to end ----------------------------------------------------------------------------------------

ROWS, BAD, ROWS_PER_PART = 400, 20, 40
KINDS = {  # kind -> (stage, code)
    "missing": ("prompt", "MISSING_COLUMN"),
    "null": ("prompt", "NULL_VALUE"),
    "template": ("prompt", "TEMPLATE_ERROR"),
    "long": ("tokenize", "PROMPT_TOO_LONG"),
    "badid": ("read", "BAD_ROW"),
}
SPEC = """\
model:
  path: {model}
input:
  path: {data}
  format: jsonl
  id_column: rid
prompt:
  mode: raw
  template: "Review ({{{{ '%d' % stars }}}} stars): {{{{ review }}}}"
sampling:
  max_tokens: 2
  seed: 3
output:
  path: {root}/default-out
runtime:
  executor: local
  rows_per_part: {rows_per_part}
  sort_window: {rows_per_part}
  max_error_fraction: 0.06
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_checkpoint):
    """(spec, expected {error id: (stage, code)}, good ids)."""
    root = tmp_path_factory.mktemp("poison")
    rng = random.Random(5)
    positions = sorted(rng.sample(range(ROWS), BAD))
    kind_at = dict(zip(positions, rng.sample(list(KINDS) * (BAD // len(KINDS)), BAD)))
    rows, expected, good = [], {}, []
    for i in range(ROWS):
        row = {"rid": f"p{i:04d}", "stars": 1 + i % 5, "review": "good product " * (1 + i % 3)}
        kind = kind_at.get(i)
        if kind == "missing":
            del row["review"]
        elif kind == "null":
            row["review"] = None
        elif kind == "template":
            row["stars"] = "five"
        elif kind == "long":
            row["review"] = "very " * 1500  # far beyond the tiny model's 512 positions
        elif kind == "badid":
            row["rid"] = [i]  # then the row is named by position: "{file}:{row}"
        rows.append(row)
        if kind:
            expected[f"reviews.jsonl:{i}" if kind == "badid" else row["rid"]] = KINDS[kind]
        else:
            good.append(row["rid"])
    data = write_jsonl(root / "reviews.jsonl", rows)
    spec = root / "job.yaml"
    spec.write_text(SPEC.format(model=tiny_checkpoint("llama"), data=data, root=root,
                                rows_per_part=ROWS_PER_PART))
    return spec, expected, good


@pytest.fixture(scope="module")
def within_budget(job):
    url = str(job[0].parent / "within")
    code, _, err = submit(job[0], url)
    assert code == 0, err[-3000:]
    return url


def _errors(url: str) -> dict[str, tuple[str, str]]:
    table = reader(url).read_committed("errors")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a row was quarantined twice"
    return dict(zip(ids, zip(table.column("stage").to_pylist(), table.column("code").to_pylist())))


def test_bad_rows_are_quarantined_once_with_their_code_and_the_rest_completes(job, within_budget):
    spec, expected, good = job
    ids = reader(within_budget).read_committed().column("rid").to_pylist()
    assert ids == good  # every good row once, in input order
    assert _errors(within_budget) == expected
    code, out, err = cli("status", within_budget, "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["complete"] and status["error_rows"] == BAD and status["committed_rows"] == ROWS - BAD
    assert status["error_codes"] == {c: BAD // len(KINDS) for _, c in KINDS.values()}


def test_over_budget_exits_3_after_committing_and_resumes_identically_with_a_larger_budget(job, within_budget,
                                                                                           tmp_path):
    spec, expected, _ = job
    url = str(tmp_path / "out")
    for _ in range(2):  # the verdict is the same on a rerun
        code, _, err = submit(spec, url, "--set", "runtime.max_error_fraction=0.04")
        assert code == 3 and "error budget exceeded" in err, err[-3000:]
    out = reader(url)
    assert not out.is_complete()
    for part_id, marker in out.read_markers().items():  # whatever was committed is whole
        assert marker["rows"] + marker["error_rows"] == ROWS_PER_PART, part_id
    assert set(_errors(url).items()) <= set(expected.items())
    code, _, err = submit(spec, url)  # the budget is not part of the job's identity: resumes
    assert code == 0, err[-3000:]
    got, want = snapshot(url), snapshot(within_budget)
    job_got, job_want = json.loads(got.pop("_job.json")), json.loads(want.pop("_job.json"))
    assert job_got["fingerprint"] == job_want["fingerprint"]  # (its spec records the first run's budget)
    assert got == want


def test_outputs_cut_off_by_max_tokens_are_quarantined_as_truncated(job, tmp_path):
    spec = job[0]
    url = str(tmp_path / "out")
    schema = json.dumps({"type": "object", "properties": {"label": {"type": "string"}},
                         "required": ["label"]})
    code, _, err = submit(spec, url, "--set", f"output_schema={schema}", "--set", "sampling.max_tokens=1",
                          "--set", "runtime.max_error_fraction=1.0")
    assert code == 0, err[-3000:]
    errors = _errors(url)
    truncated = {k for k, v in errors.items() if v == ("generate", "TRUNCATED")}
    assert truncated and set(errors) - truncated == set(job[1])  # every generated row was cut off
    assert reader(url).read_committed().num_rows == 0
    assert len(reader(url).read_markers()) == ROWS // ROWS_PER_PART
