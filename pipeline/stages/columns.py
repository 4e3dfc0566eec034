"""Internal columns that carry rows between the pipeline stages (names start with `__`).

Every stage emits a table with a fixed Arrow schema (nulls where a value does not apply), so blocks from
different files and parts concatenate without type promotion: a row's bytes never depend on which rows
travelled in the same block. Input values travel as JSON text for the same reason.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
from typing import Any

import pyarrow as pa

# Where the row is: part id, file index, row index in the file, "relpath:row" for messages.
LOCATION = [("__part", pa.string()), ("__file", pa.int32()), ("__row", pa.int64()), ("__source", pa.string())]
# Quarantine: set on the first stage that fails the row; later stages pass the row through untouched.
ERROR = [("__err_stage", pa.string()), ("__err_code", pa.string()), ("__err_msg", pa.string())]

READ_SCHEMA = pa.schema([*LOCATION, ("__input", pa.string()), *ERROR])
# __aux (JSON text, null when unused): what a row asks beyond its prompt text: "messages" (a conversation
# for the chat template), "params" (per-row sampling overrides, OpenAI Batch bodies), "schema" (a per-row
# response_format schema), "choices" (choice_loglikelihood options; after tokenize also "choice_ids" and
# "choice_ctx", each option's prompt + continuation ids and where the continuation starts).
PROMPT_SCHEMA = pa.schema([
    *LOCATION, ("__row_id", pa.string()), ("__keep", pa.string()), ("__user", pa.string()),
    ("__system", pa.string()), *ERROR, ("__aux", pa.string()),
])
TOKENIZE_SCHEMA = pa.schema([*PROMPT_SCHEMA, ("__ids", pa.list_(pa.int32())), ("__plen", pa.int32())])
ENGINE_SCHEMA = pa.schema([
    *LOCATION, ("__row_id", pa.string()), ("__keep", pa.string()), *ERROR, ("__plen", pa.int32()),
    ("__text", pa.string()), ("__finish", pa.string()), ("__ntok", pa.int32()), ("__seed", pa.int64()),
    ("__json", pa.string()), ("__engine", pa.string()), ("__gen_s", pa.float64()),
    # Wall-clock (epoch) time the row's engine sampled its first token of the run: the summary's
    # time_to_first_token_s, measured where it happens (an engine actor) and carried back with the rows.
    ("__t_first", pa.float64()),
    # JSON text, null when unused: "samples" (every sample's text, finish, ntok, seed, json, logprobs when
    # sampling.n > 1, logprobs are asked for, or the row is a Batch request), "prompt_logprobs", "loglik"
    # (choice_loglikelihood: one log-likelihood per option), "usage"/"model" for Batch output.
    ("__extra", pa.string()),
    # JSON text on the first generated row of each engine call, null elsewhere: that call's MTP deltas
    # ("drafted", "accepted", "verify_steps") and the engine's state after it ("enabled", "active",
    # "disabled_reason", "estimated_speedup", "verify_steps_total"), summed by the driver (summary.py);
    # on each part's first row also "timing": the part's engine figures (generate.with_timing), which the
    # summary's `startup` object reads. Last so older tables concatenate; never written to parts
    # (assemble.py picks named columns).
    ("__spec", pa.string()),
    # The numerics stack of the engine that generated the row (engine/runner/numerics_stack.py), null for
    # rows no engine ran: what a commit checks and records (output/numerics.py).
    ("__numerics", pa.string()),
])


def table(rows: dict[str, list], schema: pa.Schema) -> pa.Table:
    """Build a table with exactly `schema` from column lists (missing columns become nulls)."""
    n = len(next(iter(rows.values()))) if rows else 0
    arrays = [pa.array(rows.get(f.name, [None] * n), type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _json_default(value: Any) -> Any:
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot carry a {type(value).__name__} value through the pipeline")


def dumps(value: Any) -> str:
    """Compact JSON used to carry input values (datetimes as ISO text, bytes tagged base64)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_json_default)


def loads(text: str) -> Any:
    """Inverse of `dumps` (bytes come back as bytes)."""
    return json.loads(text, object_hook=_object_hook)


def _object_hook(obj: dict) -> Any:
    if len(obj) == 1 and "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    return obj
