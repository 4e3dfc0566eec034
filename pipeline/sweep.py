"""The `sweep:` section: one submit runs every point of a parameter grid, each as its own exactly-once job.

Layout under the sweep's output.path::

    _sweep.json            the points (id + settings) and the sweep spec, rewritten by every submit
    points/<point-id>/     one complete job output per point (_job.json, parts/, _commits/, _SUCCESS, ...)
    metrics.parquet        with `eval:`: one row per point and metric, once every point is complete

A point is the sweep's spec with the `sweep` section removed, the point's values set and output.path moved
to points/<point-id>/. It is fingerprinted, committed and resumed exactly like a job submitted alone with
those settings (which is why running one point alone gives the same bytes), so a killed sweep resumes
point by point and a finished point is never recomputed. Each model is built once per sweep
(sweep_run.py): on the local executor the points run one after the other over one EngineCache; on the
Ray executor the points that share engine settings run through one Ray Data pipeline and actor pool.

Point ids: "key=value" pairs joined by ',' (grid keys, then zip keys, in spec order); values as JSON
(strings bare); characters other than letters, digits and ``._=,+-`` become '_', and a long id is cut and
suffixed with a hash, so an id is always one safe path segment.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

SWEEP_FILE = "_sweep.json"
POINTS_DIR = "points"
SWEEP_METRICS_FILE = "metrics.parquet"
MAX_POINTS = 10_000
MAX_ID_CHARS = 180
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+\-]")


@dataclass(frozen=True)
class SweepPoint:
    """One point: its id, the values it sets (dotted key -> value) and its full spec document."""

    id: str
    values: dict[str, Any]
    document: dict


def _combinations(section: dict) -> list[dict[str, Any]]:
    grid, zipped = section.get("grid") or {}, section.get("zip") or {}
    grid_points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else [{}]
    steps = [dict(zip(zipped, step)) for step in zip(*zipped.values())] if zipped else [{}]
    return [{**g, **z} for g in grid_points for z in steps]


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def point_id(values: dict[str, Any]) -> str:
    """The readable, filesystem-safe id of a point (see the module docstring)."""
    text = ",".join(f"{k}={_value_text(v)}" for k, v in values.items()) or "default"
    safe = _UNSAFE.sub("_", text)
    if safe.startswith("."):
        safe = "_" + safe[1:]
    if len(safe) > MAX_ID_CHARS:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        safe = f"{safe[:MAX_ID_CHARS - 13]}~{digest}"
    return safe


def sweep_problems(section: Any) -> list[str]:
    """What the schema cannot say: zip lists share one length, no key twice, ids distinct, size bounded."""
    if not isinstance(section, dict):
        return []
    problems = []
    grid, zipped = section.get("grid") or {}, section.get("zip") or {}
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        problems.append(f"sweep.zip: every list must have the same length, got lengths {sorted(lengths)}")
    for key in sorted(set(grid) & set(zipped)):
        problems.append(f"sweep: {key} is in both grid and zip; name each key once")
    count = math.prod(len(v) for v in grid.values()) * (min(lengths) if lengths else 1)
    if count > MAX_POINTS:
        problems.append(f"sweep: {count:,} points; a sweep is limited to {MAX_POINTS:,}")
    elif not problems:
        ids = [point_id(v) for v in _combinations(section)]
        for dup in sorted({i for i in ids if ids.count(i) > 1}):
            problems.append(f"sweep: two points have the id {dup!r} (values that differ only in characters "
                            "that are not path-safe); change one value")
    return problems


def _set(doc: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = doc
    for name in parts[:-1]:
        node = node.setdefault(name, {})
    node[parts[-1]] = copy.deepcopy(value)


def point_url(root: str, pid: str) -> str:
    return f"{root.rstrip('/')}/{POINTS_DIR}/{pid}"


def expand_points(document: dict) -> list[SweepPoint]:
    """The sweep's points in order (grid combinations, each crossed with the zip steps)."""
    base = {k: v for k, v in document.items() if k != "sweep"}
    out = []
    for values in _combinations(document["sweep"]):
        doc = copy.deepcopy(base)
        for key, value in values.items():
            _set(doc, key, value)
        pid = point_id(values)
        doc["output"]["path"] = point_url(document["output"]["path"], pid)
        out.append(SweepPoint(pid, values, doc))
    return out


def point_specs(spec: Any) -> list[tuple[SweepPoint, Any]]:
    """(point, validated JobSpec) per point; a point whose values make an invalid spec is exit 2."""
    from deepinfer.pipeline.spec.load import JobSpec, SpecError

    out = []
    for point in expand_points(spec.document):
        try:
            out.append((point, JobSpec.from_document(point.document)))
        except SpecError as exc:
            raise SpecError([f"sweep point {point.id}: {p}" for p in exc.problems]) from None
    return out


def _write_json(url: str, storage_options: dict, name: str, value: Any) -> None:
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import dumps

    fs, root = storage.open_fs(url, storage_options)
    storage.write_atomic(fs, storage.join(root, name), dumps(value))


def run_sweep(spec: Any, options: Any) -> int:
    """Run every point (skipping finished ones); returns the first non-zero point exit code, else 0."""
    from deepinfer.pipeline.errors import OutputPathError
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import JOB_FILE
    from deepinfer.pipeline.sweep_run import run_points

    points = point_specs(spec)
    fs, root = storage.open_fs(spec.output.path, dict(spec.output.storage_options))
    if storage.read_bytes(fs, storage.join(root, JOB_FILE)) is not None:
        raise OutputPathError(f"output.path: {spec.output.path} holds a job that is not a sweep; give the "
                              "sweep an output path of its own")
    record = {"points": [{"id": p.id, "values": p.values} for p, _ in points], "spec": spec.document}
    _write_json(spec.output.path, dict(spec.output.storage_options), SWEEP_FILE, record)
    summaries = run_points(points, options)
    code = next((rc for rc in summaries.values() if rc), 0)
    if spec.eval is not None and code == 0:
        write_sweep_metrics(spec, [p for p, _ in points])
    if options.summary_json:
        with open(options.summary_json, "w", encoding="utf-8") as f:
            json.dump({"sweep": spec.output.path, "points": summaries}, f, indent=2, sort_keys=True)
            f.write("\n")
    return code


def write_sweep_metrics(spec: Any, points: list[SweepPoint]) -> None:
    """metrics.parquet beside points/: one row per point and metric, from each point's metrics.json."""
    import pyarrow as pa
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.encoding import encode_table
    from deepinfer.pipeline.output.layout import METRICS_FILE

    keys = list(dict.fromkeys(k for p in points for k in p.values))
    rows: dict[str, list] = {"point": [], **{k: [] for k in keys}, "metric": [], "n": [], "mean": [],
                             "stderr": []}
    so = dict(spec.output.storage_options)
    for p in points:
        fs, root = storage.open_fs(point_url(spec.output.path, p.id), so)
        metrics = json.loads(storage.read_bytes(fs, storage.join(root, METRICS_FILE)) or b"{}")
        for name, m in (metrics.get("metrics") or {}).items():
            rows["point"].append(p.id)
            for k in keys:  # as JSON text: one column type whatever the values' types
                rows[k].append(_value_text(p.values[k]) if k in p.values else None)
            rows["metric"].append(name)
            for f in ("n", "mean", "stderr"):
                rows[f].append(m[f])
    types = {"n": pa.int64(), "mean": pa.float64(), "stderr": pa.float64()}
    table = pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in rows.items()})
    fs, root = storage.open_fs(spec.output.path, so)
    storage.write_atomic(fs, storage.join(root, SWEEP_METRICS_FILE), encode_table(table, "parquet"))


def read_sweep(url: str, storage_options: dict | None = None) -> dict | None:
    """The `_sweep.json` record at `url`, or None when `url` is not a sweep's output."""
    from deepinfer.pipeline.output import storage

    fs, root = storage.open_fs(url, storage_options)
    data = storage.read_bytes(fs, storage.join(root, SWEEP_FILE))
    return None if data is None else json.loads(data)
