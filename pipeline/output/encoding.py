"""Deterministic serialization of result/error tables: the same rows always give the same bytes.

Parquet: one row group, zstd level 3, dictionary encoding and statistics on, format 2.6, page index off, no
extra key-value metadata beyond the Arrow schema pyarrow stores (which has no timestamps). JSONL: one
JSON object per row in column order, ``ensure_ascii=False``, compact separators, '\\n' after every row;
non-JSON values become strings (datetimes/dates ISO 8601, decimals ``str``, bytes base64) and non-finite
floats become null, so every line is valid JSON.

"Same bytes" holds for one software stack (pyarrow writes its version into Parquet footers), which is the
scope of deepinfer's byte-identity promise.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import io
import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("parquet", "jsonl", "openai_batch")  # openai_batch: Batch API lines (batch_lines.py)
EXTENSIONS = {"parquet": "parquet", "jsonl": "jsonl", "openai_batch": "jsonl"}


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"output.format must be one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def encode_table(table: pa.Table, fmt: str) -> bytes:
    """Serialize ``table`` (rows in the order given) to bytes in ``fmt``; deterministic."""
    check_format(fmt)
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(
            table.combine_chunks(),
            buf,
            row_group_size=max(1, table.num_rows),
            compression="zstd",
            compression_level=3,
            use_dictionary=True,
            write_statistics=True,
            version="2.6",
            write_page_index=False,
            store_schema=True,
        )
        return buf.getvalue()
    if fmt == "openai_batch":
        from deepinfer.pipeline.output.batch_lines import encode_lines

        return encode_lines(table)
    lines = [
        json.dumps(_jsonable(row), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        for row in table.to_pylist()
    ]
    return "".join(line + "\n" for line in lines).encode("utf-8")


def decode_table(data: bytes, fmt: str) -> pa.Table:
    """Read back what :func:`encode_table` wrote (JSONL types are inferred from the values)."""
    check_format(fmt)
    if fmt == "parquet":
        return pq.read_table(io.BytesIO(data))
    if fmt == "openai_batch":
        from deepinfer.pipeline.output.batch_lines import decode_lines

        return decode_lines(data)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
    return pa.Table.from_pylist(rows)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return value
