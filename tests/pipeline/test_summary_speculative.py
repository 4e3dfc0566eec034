"""The run summary's `speculative` section: MTP drafted/accepted tokens, verify steps, the engine's state and
estimated speed-up, carried back from the engine stage with the rows (`__spec`) and summed by the driver.

End to end on a tiny DeepSeek-V3 checkpoint whose MTP layer always agrees with the target
(tests/support/tiny_deepseek.py `write_mtp_layer(agree=True)`), local executor: with
DEEPINFER_ENABLE_MTP_VARLEN=1 drafts are made and counted, and the parts are byte-identical to the job
without MTP, whose section holds zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deepinfer.engine.spec_decode.config import MTP_ENV
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.summary import RunStats, format_summary, validate_summary

from tests.support.pipeline_helpers import output_digest, write_jsonl, write_spec
from tests.support.tiny_deepseek import make_tiny_deepseek, write_mtp_layer


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tiny_mtp_job")
    return str(write_mtp_layer(make_tiny_deepseek("v3_qnull", root / "agree"), agree=True))


def _run_job(tmp_path: Path, model: str, name: str) -> tuple[dict, Path]:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": f"r{i}", "text": f"item {i} is number {i * 7}"} for i in range(6)])
    out = tmp_path / name
    doc = {
        "model": {"path": model},
        "input": {"path": str(inp), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "{{ text }}"},
        "sampling": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
        "output": {"path": str(out), "format": "jsonl"},
        "runtime": {"executor": "local", "rows_per_part": 3, "batch_size": 3},
    }
    assert main(["submit", write_spec(tmp_path / f"{name}.yaml", doc)]) == 0
    summary = json.loads((out / "_SUCCESS").read_text())["summary"]
    validate_summary(summary)
    return summary, out


def test_mtp_job_reports_drafts_and_matches_the_plain_job(tmp_path, mtp_model, monkeypatch, capsys) -> None:
    plain, plain_out = _run_job(tmp_path, mtp_model, "plain")
    spec = plain["speculative"]
    assert spec["enabled"] is False and spec["active"] is False and spec["disabled_reason"] is None
    assert spec["drafted_tokens"] == spec["accepted_tokens"] == spec["verify_steps"] == 0
    assert spec["acceptance_rate"] == spec["estimated_speedup"] == 0.0
    assert [e["drafted_tokens"] for e in spec["engines"]] == [0]
    assert "  mtp " not in capsys.readouterr().out

    monkeypatch.setenv(MTP_ENV, "1")
    mtp, mtp_out = _run_job(tmp_path, mtp_model, "mtp")
    spec = mtp["speculative"]
    assert spec["enabled"] is True and spec["active"] is True and spec["disabled_reason"] is None
    assert spec["drafted_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["verify_steps"] > 0
    rate = spec["accepted_tokens"] / spec["drafted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(rate, abs=1e-6)
    per_step = spec["accepted_tokens"] / spec["verify_steps"]
    assert spec["mean_accepted_tokens_per_step"] == pytest.approx(per_step, abs=1e-6)
    assert spec["mean_tokens_per_verify_step"] == pytest.approx(1 + per_step, abs=1e-6)
    # Every draft is accepted; short outputs on a 2-layer model still pay the draft pass's modelled cost.
    assert spec["acceptance_rate"] == 1.0 and spec["estimated_speedup"] > 0.0
    (engine,) = spec["engines"]
    assert engine["engine"] == mtp["engines"][0]["engine"]
    assert engine["drafted_tokens"] == spec["drafted_tokens"]
    assert "  mtp       " in capsys.readouterr().out
    assert mtp["tokens"]["output"] == plain["tokens"]["output"] == 6 * 8
    assert output_digest(mtp_out) == output_digest(plain_out)
    for part in (mtp_out / "parts").iterdir():
        assert not [k for r in part.read_text().splitlines() for k in json.loads(r) if k.startswith("__")]


def _engine_rows(engine: str, spec: list[dict | None]) -> pa.Table:
    n = len(spec)
    return C.table({"__engine": [engine] * n, "__ntok": [2] * n, "__plen": [3] * n, "__gen_s": [0.5] * n,
                    "__spec": [None if s is None else json.dumps(s) for s in spec]}, C.ENGINE_SCHEMA)


def _figures(drafted: int, accepted: int, steps: int, total: int, speedup: float, active: bool = True,
             reason: str | None = None) -> dict:
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps, "enabled": True,
            "active": active, "disabled_reason": reason, "estimated_speedup": speedup,
            "verify_steps_total": total}


def test_driver_sums_deltas_per_engine_whatever_order_batches_arrive() -> None:
    stats = RunStats(rows_total=6, parts_total=3)
    # Engine b's later batch (after it turned drafting off) arrives before its earlier one.
    stats.add_batch(_engine_rows("b", [_figures(0, 0, 0, 10, 0.8, False, "no gain"), None]))
    stats.add_batch(_engine_rows("a", [_figures(12, 9, 4, 4, 1.5), None]))
    stats.add_batch(_engine_rows("b", [_figures(6, 1, 10, 10, 0.8), None]))
    stats.add_batch(_engine_rows("a", [_figures(3, 3, 1, 5, 1.6)]))
    summary = stats.summary(job=None, output="/o", fingerprint=None, max_fraction=0.0, exit_code=0)
    validate_summary(summary)
    spec = summary["speculative"]
    a, b = spec["engines"]
    assert (a["engine"], a["drafted_tokens"], a["accepted_tokens"], a["verify_steps"]) == ("a", 15, 12, 5)
    assert a["active"] is True and a["estimated_speedup"] == 1.6  # the latest snapshot, by verify steps
    assert (b["active"], b["disabled_reason"], b["estimated_speedup"]) == (False, "no gain", 0.8)
    assert (spec["drafted_tokens"], spec["accepted_tokens"], spec["verify_steps"]) == (21, 13, 15)
    assert spec["active"] is True and spec["disabled_reason"] == "no gain"
    assert spec["acceptance_rate"] == round(13 / 21, 6)
    assert spec["mean_tokens_per_verify_step"] == round(1 + 13 / 15, 6)
    assert spec["estimated_speedup"] == round((1.6 * 5 + 0.8 * 10) / 15, 6)
    line = next(ln for ln in format_summary(summary).splitlines() if ln.startswith("  mtp"))
    assert "21 drafted, 13 accepted (61.9%)" in line and "turned off: no gain" in line
    assert summary["engines"][0]["rows"] == 3  # the engine figures are untouched


def test_rows_without_spec_figures_give_the_zero_section() -> None:
    stats = RunStats(rows_total=1, parts_total=1)
    legacy = _engine_rows("a", [None]).drop_columns(["__spec"])  # a table from before the column existed
    stats.add_batch(legacy)
    summary = stats.summary(job=None, output="/o", fingerprint=None, max_fraction=0.0, exit_code=0)
    validate_summary(summary)
    assert summary["speculative"] == {
        "enabled": False, "active": False, "disabled_reason": None, "drafted_tokens": 0, "accepted_tokens": 0,
        "verify_steps": 0, "acceptance_rate": 0.0, "mean_accepted_tokens_per_step": 0.0,
        "mean_tokens_per_verify_step": 0.0, "estimated_speedup": 0.0, "engines": []}
