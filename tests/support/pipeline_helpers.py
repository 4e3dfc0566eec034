"""Helpers for the pipeline end-to-end tests: sample inputs, spec files, reading an output back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

TOPICS = ["battery", "shipping", "price", "quality"]


def review_rows(n: int, start: int = 0) -> list[dict]:
    return [{"rid": f"r{start + i:03d}", "text": f"Item {start + i} review: works, {TOPICS[i % 4]} is fine.",
             "topic": TOPICS[(start + i) % 4]} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict], blank_lines: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows]
    if blank_lines:
        lines.insert(1, "")  # blank lines are skipped, not rows
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_spec(path: Path, doc: dict) -> str:
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


def output_digest(root: Path) -> dict[str, str]:
    """sha256 of every committed data file and marker (everything but _SUCCESS, _job.json, leases)."""
    out = {}
    for sub in ("parts", "errors", "_commits"):
        for f in sorted((root / sub).glob("*")) if (root / sub).is_dir() else []:
            out[f"{sub}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def read_parts(root: Path, sub: str = "parts") -> pa.Table | None:
    files = sorted((root / sub).glob("*"))
    if not files:
        return None
    if files[0].suffix == ".parquet":
        return pa.concat_tables([pq.read_table(f) for f in files])
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    return pa.Table.from_pylist(rows)
