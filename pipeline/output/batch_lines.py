"""`output.format: openai_batch`: OpenAI Batch API output lines, for result and error files alike.

A result table (stages/openai_batch_output.py) has columns id, custom_id, response, error, where response
and error hold compact JSON text: each becomes one line `{"id", "custom_id", "response", "error"}` with the
JSON embedded as is, so the bytes are fixed by the table. An errors table (errors.ERROR_SCHEMA) becomes the
Batch API's error-file lines: `response` null and `error` {code, message}, the message prefixed with the
stage ("prompt: ..."). Decoding gives back the same tables (an error file back as ERROR_SCHEMA rows).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

ERROR_COLUMNS = ["id", "stage", "code", "message"]
LINE_COLUMNS = ["id", "custom_id", "response", "error"]


def request_hash(custom_id: str) -> str:
    """A stable 24-hex-digit key of a request: the line id is batch_req_<it> (no clocks, no randomness)."""
    return hashlib.sha256(custom_id.encode("utf-8")).hexdigest()[:24]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_lines(table: pa.Table) -> bytes:
    lines = []
    if table.column_names == ERROR_COLUMNS:
        for r in table.to_pylist():
            error = {"code": r["code"], "message": f"{r['stage']}: {r['message']}"}
            lines.append(_dumps({"id": f"batch_req_{request_hash(r['id'])}", "custom_id": r["id"],
                                 "response": None, "error": error}))
    else:
        for r in table.to_pylist():
            lines.append(f'{{"id":{_dumps(r["id"])},"custom_id":{_dumps(r["custom_id"])},'
                         f'"response":{r["response"] or "null"},"error":{r["error"] or "null"}}}')
    return "".join(line + "\n" for line in lines).encode("utf-8")


def decode_lines(data: bytes) -> pa.Table:
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
    if rows and all(r.get("response") is None and r.get("error") is not None for r in rows):
        out = {c: [] for c in ERROR_COLUMNS}
        for r in rows:
            stage, _, message = r["error"]["message"].partition(": ")
            for c, v in zip(ERROR_COLUMNS, (r["custom_id"], stage, r["error"]["code"], message)):
                out[c].append(v)
        return pa.table({c: pa.array(v, pa.string()) for c, v in out.items()})
    cols: dict[str, list] = {c: [] for c in LINE_COLUMNS}
    for r in rows:
        cols["id"].append(r["id"])
        cols["custom_id"].append(r["custom_id"])
        cols["response"].append(None if r.get("response") is None else _dumps(r["response"]))
        cols["error"].append(None if r.get("error") is None else _dumps(r["error"]))
    return pa.table({c: pa.array(v, pa.string()) for c, v in cols.items()})
