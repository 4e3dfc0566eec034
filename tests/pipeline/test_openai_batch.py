"""OpenAI Batch files: a Batch input with mixed per-row parameters (n, logprobs, response_format, stop,
max_tokens / max_completion_tokens, seeds) round-trips into Batch-format output lines whose fields are
checked against the Batch API's documented output shape and parsed with the `openai` package's types
(ChatCompletion for response bodies, BatchError for error objects; a test dependency); invalid lines
land in the errors file in the same shape; reruns, resumes after an interrupted run and `verify` give the
same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.output.commit import OutputStore

from tests.support.pipeline_helpers import output_digest, write_jsonl, write_spec

# A test extra (the README's test install has it); machines with only the runtime (the GPU host running
# `-m gpu`) skip this module instead of failing the whole collection.
pytest.importorskip("openai", reason="the openai package (a test extra) parses the Batch output types")
from openai.types.batch_error import BatchError  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def _line(cid: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "tiny-test", "messages": SYSTEM_USER, **body}}


LINES = [
    _line("req-1", max_tokens=3, temperature=0, seed=11),
    _line("req-2", max_completion_tokens=4, temperature=1.0, top_p=0.9, n=2, stop=["\n"], logprobs=True,
          top_logprobs=2, seed=3),
    _line("req-3", max_tokens=24, temperature=0.7,
          response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA,
                                                                  "strict": True}}),
    _line("req-4", temperature=5),
    _line("req-5", url="/v1/embeddings"),
    {**_line("req-6"), "body": {"messages": [{"role": "user"}]}},
    _line("req-7", tools=[]),
]
EXPECTED_ERRORS = {"req-4": "BAD_REQUEST", "req-5": "BAD_REQUEST", "req-6": "BAD_MESSAGES",
                   "req-7": "BAD_REQUEST"}


def _spec(tmp_path: Path, model_dir: str, out: Path) -> str:
    return write_spec(tmp_path / f"{out.name}.yaml", {
        "model": {"path": model_dir},
        "input": {"path": str(tmp_path / "in" / "batch.jsonl"), "format": "openai_batch"},
        "prompt": {"mode": "chat"},
        "sampling": {"max_tokens": 8},
        "output": {"path": str(out), "format": "openai_batch"},
        "runtime": {"executor": "local", "rows_per_part": 3, "max_error_fraction": 1.0},
    })


def _lines(root: Path, sub: str) -> list[dict]:
    files = sorted((root / sub).glob("*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _check_completion(body: dict) -> None:
    """The chat.completion fields the Batch API documents (and openai.types.chat.ChatCompletion needs)."""
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and isinstance(body["created"], int)
    assert body["id"].startswith("chatcmpl-") and body["model"] == "tiny-test"
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # openai (a test dependency) parses it with its own type, and nothing is lost or coerced on the way
    parsed = ChatCompletion.model_validate(body)
    assert parsed.model_dump(mode="json", exclude_unset=True) == body


def test_batch_round_trip_mixed_params_errors_resume(model_dir: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "in" / "batch.jsonl", LINES)
    out = tmp_path / "out"
    assert main(["submit", _spec(tmp_path, model_dir, out)]) == 0
    results = {r["custom_id"]: r for r in _lines(out, "parts")}
    assert sorted(results) == ["req-1", "req-2", "req-3"]
    for r in results.values():
        assert list(r) == ["id", "custom_id", "response", "error"] and r["error"] is None
        assert r["id"].startswith("batch_req_")
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"].startswith("req_")
        _check_completion(r["response"]["body"])
    b1, b2, b3 = (results[c]["response"]["body"] for c in ("req-1", "req-2", "req-3"))
    assert len(b1["choices"]) == 1 and b1["usage"]["completion_tokens"] <= 3
    assert b1["choices"][0]["logprobs"] is None
    assert len(b2["choices"]) == 2 and b2["usage"]["completion_tokens"] <= 8
    contents = [c["logprobs"]["content"] for c in b2["choices"]]
    assert sum(len(c) for c in contents) == b2["usage"]["completion_tokens"]
    for entry in (e for c in contents for e in c):
        assert len(entry["top_logprobs"]) == 2 and entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    assert all("\n" not in c["message"]["content"] for c in b2["choices"])  # its stop string
    jsonschema.validate(json.loads(b3["choices"][0]["message"]["content"]), SCHEMA)  # its response_format
    assert b1["usage"]["prompt_tokens"] == b2["usage"]["prompt_tokens"]  # one conversation, one prompt

    errors = {e["custom_id"]: e for e in _lines(out, "errors")}
    assert {c: e["error"]["code"] for c, e in errors.items()} == EXPECTED_ERRORS
    for e in errors.values():
        assert list(e) == ["id", "custom_id", "response", "error"] and e["response"] is None
        assert set(e["error"]) == {"code", "message"} and e["error"]["message"].startswith("prompt: ")
        assert BatchError.model_validate(e["error"]).model_dump(exclude_unset=True) == e["error"]
    assert "body.temperature: 5 is outside" in errors["req-4"]["error"]["message"]
    assert "body.tools: not supported" in errors["req-7"]["error"]["message"]

    again = tmp_path / "again"  # interrupted after its first commit, then resumed: identical bytes
    spec = _spec(tmp_path, model_dir, again)
    monkeypatch.setattr(OutputStore, "default_hooks", type("Crash", (), {"reached": _crash})())
    assert main(["submit", spec]) != 0
    monkeypatch.setattr(OutputStore, "default_hooks", None)
    assert main(["submit", spec]) == 0
    assert output_digest(again) == output_digest(out)
    assert main(["status", str(out), "--json"]) == 0
    assert main(["verify", str(out), "--sample", "3"]) == 0


def _crash(self: object, point: str) -> None:
    if point == "after_part_committed":
        raise RuntimeError("simulated crash after the first commit")


def test_batch_output_needs_batch_input(tmp_path: Path) -> None:
    from deepinfer.pipeline.spec.load import JobSpec, SpecError

    doc = {"model": {"name": "demo"}, "input": {"path": str(tmp_path / "x.jsonl"), "format": "jsonl"},
           "prompt": {"template": "{{ q }}"},
           "output": {"path": str(tmp_path / "o"), "format": "openai_batch"}}
    with pytest.raises(SpecError, match=r"output\.format: openai_batch output lines are keyed by custom_id"):
        JobSpec.from_document(doc)


@pytest.mark.parametrize(("body", "expected"), [
    ({"max_tokens": 3, "max_completion_tokens": 4},
     "body.max_tokens and body.max_completion_tokens disagree"),
    ({"top_logprobs": 2}, "body.top_logprobs: needs body.logprobs: true"),
    ({"top_p": 0}, "body.top_p: 0 is outside (0, 1]"),
    ({"n": 0}, "body.n: 0 is outside [1, 128]"),
    ({"seed": "7"}, "body.seed: expected an integer"),
    ({"stop": [""]}, "body.stop: expected a non-empty string"),
    ({"stream": True}, "body.stream: a batch request cannot stream"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
     "body.response_format.json_schema.schema: not a valid JSON Schema"),
    ({"response_format": {"type": "xml"}}, "body.response_format: expected {type: text"),
])
def test_invalid_body_parameters_are_named(body: dict, expected: str) -> None:
    from deepinfer.pipeline.stages.requests import parse_batch_request

    request, problem = parse_batch_request(_line("x", **body))
    assert request is None and problem[0] == "BAD_REQUEST" and problem[1].startswith(expected), problem


def test_valid_body_becomes_per_row_overrides() -> None:
    from deepinfer.pipeline.stages.requests import parse_batch_request

    request, problem = parse_batch_request(LINES[1])
    assert problem is None and request["messages"] == SYSTEM_USER and request["model"] == "tiny-test"
    assert request["params"] == {"max_tokens": 4, "temperature": 1.0, "top_p": 0.9, "n": 2, "seed": 3,
                                 "stop": ["\n"], "logprobs": 2}
    assert parse_batch_request(LINES[2])[0]["schema"] == SCHEMA
