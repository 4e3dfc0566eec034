"""`status` of a sweep's output (every point) and `deepinfer-job report OUTPUT` (an eval's metrics).

A sweep's output.path holds `_sweep.json` and one job output per point under points/; `status` shows each
point's state from its own commit markers. `report` prints metrics.parquet (one row per point and metric)
for a sweep, or metrics.json (with its groups) for a single eval job.
"""

from __future__ import annotations

import io
import json
from typing import Any

from deepinfer.pipeline.errors import ExitCode, SpecError


def sweep_status(url: str, storage_options: dict | None) -> dict[str, Any] | None:
    """{"output", "state", "points": [point status...]} for a sweep's output, or None for a plain job."""
    from deepinfer.pipeline.output.status import job_status
    from deepinfer.pipeline.sweep import point_url, read_sweep

    record = read_sweep(url, storage_options)
    if record is None:
        return None
    points = []
    for p in record["points"]:
        status = job_status(point_url(url, p["id"]), storage_options)
        points.append({"id": p["id"], "values": p["values"], **status})
    states = {p["state"] for p in points}
    state = "complete" if states == {"complete"} else ("running" if "running" in states else "incomplete")
    return {"output": url, "state": state, "points": points}


def render_sweep_status(status: dict[str, Any]) -> str:
    done = sum(p["state"] == "complete" for p in status["points"])
    lines = [f"output:   {status['output']} (sweep)",
             f"state:    {status['state']}: {done}/{len(status['points'])} points complete"]
    width = max(len(p["id"]) for p in status["points"]) if status["points"] else 0
    for p in status["points"]:
        rows = p["committed_rows"] + p["error_rows"]
        lines.append(f"  {p['id']:<{width}}  {p['state']:<11} parts {p['committed_parts']}/{p['total_parts']}"
                     f"  rows {rows}/{p['total_rows']} ({p['error_rows']} quarantined)")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells)


def report(url: str, as_json: bool = False, storage_options: dict | None = None) -> int:
    """Print the metrics of an eval job or a sweep at `url`; exit 2 when it has none (yet)."""
    import pyarrow.parquet as pq
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import METRICS_FILE
    from deepinfer.pipeline.sweep import SWEEP_METRICS_FILE

    fs, root = storage.open_fs(url, storage_options)
    data = storage.read_bytes(fs, storage.join(root, SWEEP_METRICS_FILE))
    if data is not None:
        rows = pq.read_table(io.BytesIO(data)).to_pylist()
        if as_json:
            print(json.dumps(rows, indent=2, sort_keys=True))
        else:
            header = list(rows[0]) if rows else ["point", "metric", "n", "mean", "stderr"]
            print(_table(header, [[r[h] for h in header] for r in rows]))
        return ExitCode.OK
    data = storage.read_bytes(fs, storage.join(root, METRICS_FILE))
    if data is None:
        raise SpecError([f"OUTPUT: {url} has no {METRICS_FILE} or {SWEEP_METRICS_FILE} (not an eval job, "
                         "or not complete yet: see deepinfer-job status)"])
    metrics = json.loads(data)
    if as_json:
        print(json.dumps(metrics, indent=2, sort_keys=True))
        return ExitCode.OK
    rows = []
    for name, m in metrics["metrics"].items():
        rows.append([name, "(all)", m["n"], m["mean"], m["stderr"]])
        for group, g in (m.get("groups") or {}).items():
            rows.append([name, group, g["n"], g["mean"], g["stderr"]])
    print(f"{url}: {metrics['rows']} rows scored, {metrics['error_rows']} quarantined")
    print(_table(["metric", "group", "n", "mean", "stderr"], rows))
    return ExitCode.OK
