"""`deepinfer-job plan`: counts, token percentiles, quarantines and the estimate, checked against figures
computed here independently (plain jinja2 + the `tokenizers` library over the raw JSONL)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from deepinfer.pipeline.cli.main import main
from jinja2 import Environment
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
LABELING = ROOT / "jobs" / "labeling.yaml"


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _expected_lengths(rows: list[dict], spec: dict, model_dir: Path) -> list[int]:
    """Prompt token counts the way a chat-mode job builds them, without deepinfer's own code."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    chat = Environment(keep_trailing_newline=True).from_string(config["chat_template"])
    user = Environment(keep_trailing_newline=True).from_string(spec["prompt"]["template"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = []
    for row in rows:
        messages = [{"role": "system", "content": spec["prompt"]["system"]},
                    {"role": "user", "content": user.render(**row)}]
        text = chat.render(messages=messages, add_generation_prompt=True, bos_token=config["bos_token"])
        out.append(len(tok.encode(text, add_special_tokens=False).ids))
    return out


def _pct(values: list[int], p: float) -> int:
    return int(np.percentile(np.array(values), p, method="inverted_cdf"))


def test_plan_of_the_labeling_sample_reports_counts_tokens_and_estimate(capsys) -> None:
    spec = yaml.safe_load(LABELING.read_text())
    rows = [json.loads(line) for line in (LABELING.parent / spec["input"]["path"]).read_text().splitlines()
            if line.strip()]
    plan = _plan(capsys, str(LABELING))
    lengths = _expected_lengths(rows, spec, Path(plan["model_dir"]))
    assert plan["rows"] == {"total": len(rows), "would_run": len(rows), "quarantined": 0}
    assert plan["input"]["parts"] == math.ceil(len(rows) / spec["runtime"]["rows_per_part"])
    assert plan["prompt_tokens"] == {"total": sum(lengths), "p50": _pct(lengths, 50),
                                     "p90": _pct(lengths, 90),
                                     "p99": _pct(lengths, 99), "max": max(lengths)}
    assert plan["output_tokens_bound"] == len(rows) * spec["sampling"]["max_tokens"]
    [rate] = plan["estimate"]["rates"]  # the demo model's shape is in the table (output tok/s)
    assert rate["name"] == "demo" and rate["counts"] == "output"
    assert rate["engine_hours"] == pytest.approx(len(rows) * 48 / rate["tokens_per_s"] / 3600)


def test_plan_names_the_rows_a_submit_would_quarantine(tmp_path, capsys) -> None:
    spec = yaml.safe_load(LABELING.read_text())
    rows = [json.loads(line) for line in (LABELING.parent / spec["input"]["path"]).read_text().splitlines()
            if line.strip()][:40]
    rows[3]["review_id"] = rows[0]["review_id"]  # duplicate id: the later row is quarantined
    rows[5]["review"] = None
    del rows[7]["product"]
    rows[9]["review"] = "far too long " * 200
    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [str(LABELING), "--set", f"input.path={path}", "--set", "model.max_model_len=400",
            "--set", f"output.path={tmp_path / 'out'}"]
    plan = _plan(capsys, *args)
    q = plan["quarantined"]
    assert {c: (e["rows"], e["examples"]) for c, e in q.items()} == {
        "DUPLICATE_ID": (1, [rows[0]["review_id"]]), "NULL_VALUE": (1, [rows[5]["review_id"]]),
        "MISSING_COLUMN": (1, [rows[7]["review_id"]]), "PROMPT_TOO_LONG": (1, [rows[9]["review_id"]])}
    assert plan["rows"] == {"total": 40, "would_run": 36, "quarantined": 4}
    good = [r for i, r in enumerate(rows) if i not in (3, 5, 7, 9)]
    assert plan["prompt_tokens"]["total"] == sum(_expected_lengths(good, spec, Path(plan["model_dir"])))
    assert not (tmp_path / "out").exists()  # plan writes nothing

    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "40 total, 36 would run, 4 would be quarantined" in text
    assert "PROMPT_TOO_LONG (stage tokenize): 1 rows" in text


def test_plan_says_when_the_model_shape_has_no_measured_rate(tmp_path, capsys, model_dir) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(5)))
    spec = {"model": {"path": model_dir}, "input": {"path": str(data), "format": "jsonl"},
            "prompt": {"mode": "raw", "template": "{{ q }}"}, "sampling": {"max_tokens": 4},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl"}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    plan = _plan(capsys, str(tmp_path / "s.yaml"))
    assert plan["rows"]["would_run"] == 5 and plan["output_tokens_bound"] == 20
    assert plan["estimate"]["rates"] == [] and "no measured rate" in plan["estimate"]["note"]
    assert main(["plan", str(tmp_path / "s.yaml")]) == 0
    assert "no measured rate for this model shape" in capsys.readouterr().out
