"""choice_loglikelihood: each option's log-likelihood in the parts agrees with one computed here with HF
transformers (float32, same tiny checkpoint), using lm-evaluation-harness's context/continuation split
re-derived here; the score is the argmax against the reference (index or text); bad options quarantine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepinfer.pipeline.cli.main import main

from tests.support.pipeline_helpers import read_parts, write_jsonl, write_spec

transformers = pytest.importorskip("transformers")

TEMPLATE = "Question: {{ q }}\nAnswer: "  # trailing space: the split moves it into each option
ROWS = [
    {"qid": "a", "q": "Is the sky blue?", "options": ["yes", "no", "maybe so"], "ref": 0},
    {"qid": "b", "q": "Two plus two?", "options": ["four", "five"], "ref": "five"},
    {"qid": "c", "q": "Pick a letter.", "options": ["x", "y", "z", "w"], "ref": 3},
    {"qid": "d", "q": "Broken row.", "options": "not a list", "ref": 0},
]


def _hf_logliks(model_dir: str, context: str, options: list[str], device: str = "cpu") -> list[float]:
    """Independent reference: HF tokenizer + model; lm-eval's _encode_pair split, summed log-softmax."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = model.to(device)
    out = []
    for option in options:
        stripped = context.rstrip()
        ctx_text, cont_text = stripped, context[len(stripped):] + option
        whole = tok(ctx_text + cont_text).input_ids
        ctx = tok(ctx_text).input_ids
        ids = ctx + whole[len(ctx):]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(logprobs[p - 1, ids[p]]) for p in range(len(ctx), len(ids))))
    return out


def _run_and_check(model_dir: str, tmp_path: Path, device: str, tol: float) -> None:
    data, out = tmp_path / "in" / "mc.jsonl", tmp_path / "out"
    write_jsonl(data, ROWS)
    spec = write_spec(tmp_path / "spec.yaml", {
        "model": {"path": model_dir, "device": device},
        "input": {"path": str(data), "format": "jsonl", "id_column": "qid"},
        "prompt": {"mode": "raw", "template": TEMPLATE},
        "sampling": {"temperature": 0.0, "max_tokens": 2},
        "eval": {"reference_column": "ref", "choices_column": "options",
                 "metrics": ["choice_loglikelihood", "exact_match"]},
        "output": {"path": str(out), "format": "jsonl"},
        "runtime": {"executor": "local", "max_error_fraction": 0.5, "batch_size": 2},
    })
    assert main(["submit", spec]) == 0
    rows = {r["qid"]: r for r in read_parts(out).to_pylist()}
    assert sorted(rows) == ["a", "b", "c"]
    for src in ROWS[:3]:
        got = rows[src["qid"]]
        want = _hf_logliks(model_dir, TEMPLATE.replace("{{ q }}", src["q"]), src["options"], device)
        assert got["loglik_choice_loglikelihood"] == pytest.approx(want, abs=tol), src["qid"]
        assert all(v < 0 for v in want)
        got_ll = got["loglik_choice_loglikelihood"]
        best = max(range(len(got_ll)), key=lambda i: (got_ll[i], -i))
        ref = src["ref"] if isinstance(src["ref"], int) else src["options"].index(src["ref"])
        assert got["score_choice_loglikelihood"] == float(best == ref)
        assert got["options"] == src["options"]  # the choices column is kept next to its scores
    errors = read_parts(out, "errors").to_pylist()
    assert [(e["id"], e["stage"], e["code"]) for e in errors] == [("d", "prompt", "BAD_CHOICES")]
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]["choice_loglikelihood"]
    scores = [rows[q]["score_choice_loglikelihood"] for q in "abc"]
    assert metrics["n"] == 3 and metrics["mean"] == pytest.approx(sum(scores) / 3)


def test_choice_loglikelihood_matches_transformers(model_dir: str, tmp_path: Path) -> None:
    _run_and_check(model_dir, tmp_path, "cpu", 2e-4)


@pytest.mark.gpu
def test_choice_loglikelihood_matches_transformers_on_cuda(model_dir: str, tmp_path: Path) -> None:
    _run_and_check(model_dir, tmp_path, "cuda", 2e-3)  # TF32-free fp32 kernels, but other reduction orders


def test_choice_loglikelihood_needs_choices_column(tmp_path: Path) -> None:
    from deepinfer.pipeline.spec.load import JobSpec, SpecError

    doc = {"model": {"name": "demo"}, "input": {"path": str(tmp_path / "x.jsonl"), "format": "jsonl"},
           "prompt": {"template": "{{ q }}"}, "output": {"path": str(tmp_path / "o")},
           "eval": {"reference_column": "ref", "metrics": ["choice_loglikelihood"]}}
    with pytest.raises(SpecError, match=r"eval\.choices_column: choice_loglikelihood needs"):
        JobSpec.from_document(doc)
