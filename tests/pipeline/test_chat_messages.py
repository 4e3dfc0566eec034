"""prompt.messages_column: a column of {role, content} conversations (system and multi-turn) rendered with
the model's chat template — the prompt tokens equal HF transformers' apply_chat_template — and malformed
conversations quarantined with BAD_MESSAGES; validate names the field for specs that cannot work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.spec.load import JobSpec, SpecError

from tests.support.pipeline_helpers import read_parts, write_jsonl, write_spec

transformers = pytest.importorskip("transformers")

GOOD = {
    "g1": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    "g2": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
           {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}],
}
BAD = {
    "b1": "just a string",
    "b2": [{"role": "wizard", "content": "hi"}],
    "b3": [{"role": "user", "content": 7}],
    "b4": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    "b5": [],
}


def _doc(tmp_path: Path, model: dict, **prompt) -> dict:
    return {"model": model, "input": {"path": str(tmp_path / "in" / "c.jsonl"), "format": "jsonl",
                                      "id_column": "cid"},
            "prompt": prompt, "sampling": {"temperature": 0.0, "max_tokens": 3, "prompt_logprobs": 0},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
            "runtime": {"executor": "local", "max_error_fraction": 1.0}}


def test_messages_column_rendered_with_chat_template(model_dir: str, tmp_path: Path) -> None:
    rows = [{"cid": k, "conv": v} for k, v in {**GOOD, **BAD}.items()]
    write_jsonl(tmp_path / "in" / "c.jsonl", rows)
    spec = write_spec(tmp_path / "spec.yaml", _doc(tmp_path, {"path": model_dir}, messages_column="conv"))
    assert main(["submit", spec]) == 0
    out = {r["cid"]: r for r in read_parts(tmp_path / "out").to_pylist()}
    assert sorted(out) == sorted(GOOD)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for cid, messages in GOOD.items():
        flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p["text"] for p in m["content"])} for m in messages]
        text = tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
        want = tok(text, add_special_tokens=False).input_ids
        assert out[cid]["prompt_tokens"] == len(want)
        assert [e["token_id"] for e in out[cid]["prompt_logprobs"][1:]] == want[1:]
    errors = {e["id"]: e for e in read_parts(tmp_path / "out", "errors").to_pylist()}
    assert sorted(errors) == sorted(BAD)
    assert {(e["stage"], e["code"]) for e in errors.values()} == {("prompt", "BAD_MESSAGES")}
    assert "role 'wizard'" in errors["b2"]["message"]
    assert "content must be a string" in errors["b3"]["message"]
    assert "last message is the assistant's" in errors["b4"]["message"]


@pytest.mark.parametrize(("prompt", "expected"), [
    ({"messages_column": "conv", "mode": "raw"}, "prompt.messages_column: messages are rendered"),
    ({"messages_column": "conv", "template": "{{ x }}"}, "prompt: give exactly one of"),
    ({"messages_column": "conv", "system": "Be nice."}, "prompt.system: with prompt.messages_column"),
])
def test_messages_column_spec_errors_name_the_field(tmp_path: Path, prompt: dict, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        JobSpec.from_document(_doc(tmp_path, {"name": "demo"}, **prompt))
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems
