"""A part's results as OpenAI Batch API output rows (`output.format: openai_batch`).

One row per request: `id` (batch_req_<hash of custom_id>), `custom_id`, `response` = {status_code: 200,
request_id: req_<hash>, body: a chat.completion object}, `error` null. The body has `id` (chatcmpl-<hash>),
`object` "chat.completion", `created` 0 (fixed: the output bytes may not depend on the clock), `model`
(the body's model, else the spec's model name), `choices` (one per sample, in sample order: index,
message {role: assistant, content, refusal: null}, logprobs (null, or {content: [{token, logprob, bytes,
top_logprobs}], refusal: null} when the body asked for logprobs), finish_reason "stop" | "length"),
`usage` {prompt_tokens, completion_tokens (all samples), total_tokens} and `system_fingerprint`
"deepinfer". Quarantined rows are written by the encoder as error lines (output/batch_lines.py).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.output.batch_lines import request_hash


def _token_logprob(entry: dict) -> dict:
    def one(e: dict) -> dict:
        token = e["token"] or ""
        return {"token": token, "logprob": e["logprob"], "bytes": list(token.encode("utf-8"))}
    return {**one(entry), "top_logprobs": [one(t) for t in entry["top"]]}


class BatchOutput:
    """Builds the Batch-format result table of a part's ok rows (ENGINE_SCHEMA dicts)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def body(self, row: dict) -> dict[str, Any]:
        extra = json.loads(row["__extra"]) if row.get("__extra") else {}
        samples = extra.get("samples") or [{"text": row["__text"], "finish": row["__finish"],
                                            "ntok": row["__ntok"], "logprobs": None}]
        choices = []
        for index, s in enumerate(samples):
            logprobs = None
            if s.get("logprobs") is not None:
                logprobs = {"content": [_token_logprob(e) for e in s["logprobs"]], "refusal": None}
            choices.append({"index": index,
                            "message": {"role": "assistant", "content": s["text"], "refusal": None},
                            "logprobs": logprobs, "finish_reason": s["finish"]})
        completion = sum(int(s["ntok"] or 0) for s in samples)
        prompt = int(row["__plen"] or 0)
        return {"id": f"chatcmpl-{request_hash(row['__row_id'])}", "object": "chat.completion", "created": 0,
                "model": extra.get("model") or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion},
                "system_fingerprint": "deepinfer"}

    def table(self, ok: list[dict]) -> pa.Table:
        ids, custom, responses = [], [], []
        for r in ok:
            h = request_hash(r["__row_id"])
            ids.append(f"batch_req_{h}")
            custom.append(r["__row_id"])
            response = {"status_code": 200, "request_id": f"req_{h}", "body": self.body(r)}
            responses.append(json.dumps(response, ensure_ascii=False, separators=(",", ":"), allow_nan=False))
        return pa.table({"id": pa.array(ids, pa.string()), "custom_id": pa.array(custom, pa.string()),
                         "response": pa.array(responses, pa.string()),
                         "error": pa.array([None] * len(ok), pa.string())})
