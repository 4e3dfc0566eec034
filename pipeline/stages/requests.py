"""What a row asks for beyond a templated prompt: chat messages, choice options, OpenAI Batch request bodies.

Each parser returns (value, None) or (None, (code, message)); the prompt stage quarantines a row whose
request is malformed (stage 'prompt') with that code, so one bad line never stops a job:

* BAD_MESSAGES: `prompt.messages_column` (or a Batch body's `messages`) is not a non-empty list of
  {role, content} objects with roles system / user / assistant and text content;
* BAD_CHOICES: `eval.choices_column` is not a non-empty list of non-empty strings;
* BAD_REQUEST: a Batch line's method / url / body, or a body parameter, that deepinfer cannot honour.

A Batch body's parameters become per-row overrides of the spec's sampling section (keys of
SamplingParams), validated here with the same ranges as the spec schema, so an invalid value is named
with its body path instead of failing inside the engine.
"""

from __future__ import annotations

import math
from typing import Any

ROLES = ("system", "user", "assistant")
BATCH_URLS = ("/v1/chat/completions", "/chat/completions")
MAX_STOP = 64
Problem = tuple[str, str]


def parse_messages(value: Any, where: str) -> tuple[list[dict[str, str]] | None, Problem | None]:
    """A conversation as [{"role", "content": str}], content parts of type text joined; or a problem."""
    def bad(why: str) -> tuple[None, Problem]:
        return None, ("BAD_MESSAGES", f"{where}: {why}")

    if value is None:
        return bad("missing or null; expected a list of {role, content} messages")
    if not isinstance(value, list) or not value:
        return bad(f"expected a non-empty list of {{role, content}} messages, got {type(value).__name__}"
                   if not isinstance(value, list) else "the list of messages is empty")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return bad(f"message {i} is a {type(m).__name__}, expected an object {{role, content}}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return bad(f"message {i}: role {role!r} is not one of {list(ROLES)}")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            return bad(f"message {i}: unsupported keys {extra} (only role, content, name)")
        if isinstance(content, list):  # OpenAI content parts: only text parts can be rendered
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    return bad(f"message {i}: content part {j} is not a {{type: text, text}} part")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            return bad(f"message {i}: content must be a string (or text parts), got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        return bad("the last message is the assistant's; the conversation must end with a user or system "
                   "message for the model to answer")
    return out, None


def parse_choices(value: Any, where: str) -> tuple[list[str] | None, Problem | None]:
    if not isinstance(value, list) or not value:
        return None, ("BAD_CHOICES", f"{where}: expected a non-empty list of option strings, got "
                                     f"{'an empty list' if value == [] else type(value).__name__}")
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c:
            return None, ("BAD_CHOICES", f"{where}: option {i} must be a non-empty string")
    return list(value), None


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> tuple[Any, str | None]:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None, f"body.{key}: expected a number, got {v!r}"
    if (v <= low if low_open else v < low) or v > high:
        return None, f"body.{key}: {v} is outside {'(' if low_open else '['}{low}, {high}]"
    return float(v), None


def _integer(body: dict, key: str, low: int, high: int) -> tuple[Any, str | None]:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        return None, f"body.{key}: expected an integer, got {v!r}"
    if not low <= v <= high:
        return None, f"body.{key}: {v} is outside [{low}, {high}]"
    return v, None


def _stop(v: Any) -> tuple[Any, str | None]:
    stops = [v] if isinstance(v, str) else v
    if v is None:
        return None, None
    valid = isinstance(stops, list) and len(stops) <= MAX_STOP
    if not valid or not all(isinstance(s, str) and s for s in stops):
        return None, f"body.stop: expected a non-empty string or a list of at most {MAX_STOP} of them"
    return stops, None


def _response_format(v: Any) -> tuple[dict | None, str | None]:
    """The JSON Schema a response_format asks for (None for text), or a problem."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        return None, "body.response_format: expected {type: text | json_object | json_schema, ...}"
    if v["type"] == "text":
        return None, None
    if v["type"] == "json_object":
        return {"type": "object"}, None
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return None, "body.response_format.json_schema: expected {name, schema: {...}, strict}"
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(spec["schema"])
    except SchemaError as exc:
        return None, f"body.response_format.json_schema.schema: not a valid JSON Schema: {exc.message}"
    return spec["schema"], None


_IGNORED = ("model", "user", "metadata", "store")  # recorded or meaningless offline; no effect on sampling


def parse_batch_request(row: dict) -> tuple[dict | None, Problem | None]:
    """One OpenAI Batch input line -> {"messages", "params", "schema", "model"}, or a problem."""
    def bad(why: str) -> tuple[None, Problem]:
        return None, ("BAD_REQUEST", why)

    if row.get("method") != "POST":
        return bad(f"method: expected 'POST', got {row.get('method')!r}")
    if row.get("url") not in BATCH_URLS:
        return bad(f"url: {row.get('url')!r} is not served; deepinfer runs chat completions "
                   f"({BATCH_URLS[0]})")
    body = row.get("body")
    if not isinstance(body, dict):
        return bad(f"body: expected an object, got {type(body).__name__}")
    known = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop",
             "response_format", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
             "stream", *_IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        return bad(f"body.{unknown[0]}: not supported by deepinfer (supported: {', '.join(sorted(known))})")
    messages, problem = parse_messages(body.get("messages"), "body.messages")
    if problem is not None:
        return None, problem
    params: dict[str, Any] = {}
    checks = {"temperature": (0, 2, False), "top_p": (0, 1, True), "presence_penalty": (-2, 2, False),
              "frequency_penalty": (-2, 2, False)}
    for key, (low, high, open_) in checks.items():
        if body.get(key) is not None:
            params[key], why = _number(body, key, low, high, open_)
            if why:
                return bad(why)
    limits = {"max_tokens": (1, 10_000_000), "max_completion_tokens": (1, 10_000_000), "n": (1, 128),
              "seed": (0, 2**63 - 1), "top_logprobs": (0, 20)}
    for key, (low, high) in limits.items():
        if body.get(key) is not None:
            params[key], why = _integer(body, key, low, high)
            if why:
                return bad(why)
    if "max_tokens" in params and "max_completion_tokens" in params and \
            params["max_tokens"] != params["max_completion_tokens"]:
        return bad("body.max_tokens and body.max_completion_tokens disagree; give one")
    if "max_completion_tokens" in params:
        params["max_tokens"] = params.pop("max_completion_tokens")
    if body.get("stream"):
        return bad("body.stream: a batch request cannot stream")
    if body.get("stop") is not None:
        params["stop"], why = _stop(body["stop"])
        if why:
            return bad(why)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        return bad(f"body.logprobs: expected true or false, got {logprobs!r}")
    top = params.pop("top_logprobs", None)
    if top is not None and not logprobs:
        return bad("body.top_logprobs: needs body.logprobs: true")
    if logprobs:
        params["logprobs"] = top or 0
    schema = None
    if body.get("response_format") is not None:
        schema, why = _response_format(body["response_format"])
        if why:
            return bad(why)
    model = body.get("model")
    return {"messages": messages, "params": params, "schema": schema,
            "model": model if isinstance(model, str) else None}, None
