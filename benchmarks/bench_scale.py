"""How the job driver's cost grows with the job: rows, parts and input files (CPU, no GPU, no model).

Every case runs the real `deepinfer-job submit` (local executor, `runtime.benchmark_stub_engine: true`:
pipeline benchmark mode, one placeholder token per row, so that what is measured is the pipeline, not a
model) on short JSONL rows written to local disk, and reports:

  phases     the driver's work before the first part runs, in run_job's order, timed in a fresh process:
             check_model, list_input (listing + row counting), plan (plan_parts + part tasks),
             dedupe (the duplicate-id pass), open (fingerprint of the input + _job.json + lease + orphan
             cleanup), committed (listing _commits/ and reading the markers), assembler (kept-column
             types); with the peak of Python allocations after the imports (tracemalloc, a second run)
  submit     wall time, driver peak RSS, rows/s, committed objects (files under the output)
  resume     the same job with its last 10% of parts uncommitted (markers, data objects and _SUCCESS
             removed, as a kill at 90% leaves it): time from the submit's start to its first generated
             token (process start included), and the resume's own phases
  driver     the Ray driver's own per-part work (runner._run_parts without the executor): count the
             result block, complete the part, build its tables, commit it (local disk), over up to
             --driver-parts parts generated beforehand: the rows/s one driver can commit

Run (CPU only; record results in benchmarks/RESULTS.md with the machine's load average):
    python benchmarks/bench_scale.py --rows 10000 100000 1000000 --out /tmp/scale_rows.json
    python benchmarks/bench_scale.py --files 1000 --rows-per-file 10 --out /tmp/scale_files.json
    python benchmarks/bench_scale.py --files 1000 10000 --rows-per-file 10 --phases-only --out /tmp/f.json
    python benchmarks/bench_scale.py --files 10000 --rows-per-file 10 --driver-parts 300 --out /tmp/f10k.json
    python benchmarks/bench_scale.py --files 10000 --rows-per-file 10 --input-format parquet --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "good bad fine great awful okay nice poor cheap solid broken lovely".split()


def write_input(root: Path, rows: int, files: int, fmt: str = "jsonl") -> Path:
    """`rows` short rows ({"rid", "review"}, ~60 bytes) spread evenly over `files` JSONL or Parquet files."""
    data = root / "input"
    data.mkdir(parents=True)
    rng = random.Random(0)
    per_file = -(-rows // files)
    n = 0
    for f in range(files):
        records = []
        for _ in range(min(per_file, rows - n)):
            review = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            records.append({"rid": f"r{n:09d}", "review": review})
            n += 1
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), data / f"shard-{f:06d}.parquet")
        else:
            (data / f"shard-{f:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


def write_spec(root: Path, data: Path, rows_per_part: int, fmt: str = "jsonl") -> Path:
    spec = root / "job.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "name": "scale",
        "model": {"name": "demo"},
        "input": {"path": str(data), "format": fmt, "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ review }}"},
        "sampling": {"max_tokens": 1, "seed": 1},
        "output": {"path": str(root / "out"), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": rows_per_part, "batch_size": 1000,
                    "benchmark_stub_engine": True},
    }))
    return spec


def phases(spec_path: str, output: str, trace: bool) -> dict:
    """The driver's steps before the first part runs (runner.run_job's order), timed one by one."""
    import tracemalloc

    from deepinfer.pipeline import runner
    from deepinfer.pipeline.output.job_store import JobStore
    from deepinfer.pipeline.output.ownership import stored_rows_per_part
    from deepinfer.pipeline.spec.load import load_spec
    from deepinfer.pipeline.stages.dedupe import find_duplicates, with_duplicates
    from deepinfer.pipeline.stages.read import list_input

    spec = load_spec(spec_path, [f"output.path={output}"])
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = round(now - clock, 3)
        clock = now

    model_dir = runner.check_model(spec)  # imports the engine (torch): before tracing starts
    lap("check_model")
    import deepinfer.pipeline.evaluation  # noqa: F401 - imports of the assembler step, also untraced
    from deepinfer.pipeline.stages import assemble  # noqa: F401

    if trace:
        tracemalloc.start()
    clock = time.perf_counter()
    rows_per_part = stored_rows_per_part(spec.output.path, {}) or spec.runtime.rows_per_part
    listing = list_input(spec.input.path, spec.input.format, {}, stride=rows_per_part)
    lap("list_input")
    planned = runner.plan_job(listing, rows_per_part)
    tasks = runner.part_tasks(listing, planned)
    lap("plan")
    duplicates = runner.stored_duplicates(spec)  # a resume reuses the first run's verdict (runner.py)
    if duplicates is None:
        duplicates = find_duplicates(listing, spec.input.format, spec.input.id_column, {})
    tasks = with_duplicates(tasks, duplicates)
    lap("dedupe")
    store = JobStore.open(spec, listing, planned, model_dir, duplicates=duplicates)
    lap("open")
    committed = store.committed()
    store.committed_error_rows()
    lap("committed")
    runner.make_assembler(spec, listing)
    lap("assembler")
    store.close()
    out = {"seconds": times, "total_s": round(sum(times.values()), 3), "parts": len(planned),
           "files": len(listing), "committed": len(committed)}
    if trace:
        out["python_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
    return out


def driver_loop(spec_path: str, output: str, max_parts: int) -> dict:
    """Rows/s of what the driver does per part on the Ray executor, engines left out."""
    from deepinfer.pipeline import runner
    from deepinfer.pipeline.output.job_store import JobStore
    from deepinfer.pipeline.output.numerics import part_stacks
    from deepinfer.pipeline.spec.load import load_spec
    from deepinfer.pipeline.stages.plan import StagePlan, prepare_part
    from deepinfer.pipeline.stages.read import list_input
    from deepinfer.pipeline.summary import RunStats

    spec = load_spec(spec_path, [f"output.path={output}"])
    model_dir = runner.check_model(spec)
    listing = list_input(spec.input.path, spec.input.format, {}, stride=spec.runtime.rows_per_part)
    planned = runner.plan_job(listing, spec.runtime.rows_per_part)
    tasks = runner.part_tasks(listing, planned)[:max_parts]
    plan = StagePlan.from_spec(spec)
    engine = plan.engine_stage()
    blocks = [engine.generate_part(prepare_part(plan, t), plan.batch_size) for t in tasks]
    store = JobStore.open(spec, listing, planned, model_dir)
    assembler = runner.make_assembler(spec, listing)
    stats, collector = RunStats(rows_total=0, parts_total=0), runner.PartCollector(tasks)
    start = time.perf_counter()
    for block in blocks:
        stats.add_batch(block)
        for part, table in collector.add(block):
            ok, errors = assembler.build(table)
            store.commit(part.part_id, ok, errors, part_stacks(table))
    elapsed = time.perf_counter() - start
    store.close()
    rows = sum(t.num_rows for t in tasks)
    return {"parts": len(tasks), "rows": rows, "seconds": round(elapsed, 3),
            "rows_per_s": round(rows / elapsed, 1), "ms_per_part": round(1000 * elapsed / len(tasks), 2),
            "reports": report_loop(spec, listing, planned, tasks, blocks, model_dir, output + "-reports")}


def report_loop(spec, listing, planned, tasks, blocks, model_dir: str, output: str) -> dict:
    """What the Ray driver does per part now that engine actors commit (output/worker_commit.py): count
    the report, complete the part. The reports are made (and committed) beforehand, untimed."""
    from dataclasses import replace

    from deepinfer.pipeline import runner
    from deepinfer.pipeline.output.job_store import JobStore
    from deepinfer.pipeline.output.worker_commit import (
        CommitTarget,
        PartCommitter,
        commit_report,
        report_errors,
    )
    from deepinfer.pipeline.summary import RunStats

    spec = replace(spec, output=replace(spec.output, path=output))
    store = JobStore.open(spec, listing, planned, model_dir)
    target = CommitTarget(output, {}, dict(store.store.job["fingerprint"]), store.format,
                          store.store.run_id, runner.make_assembler(spec, listing))
    committer = PartCommitter(target, "bench")
    reports = [committer.commit(block) for block in blocks]
    committer.close()
    stats, collector = RunStats(rows_total=0, parts_total=0), runner.PartCollector(tasks)
    start = time.perf_counter()
    for block in reports:
        stats.add_batch(block)
        for part, table in collector.add(block):
            info = commit_report(table)
            stats.add_commit(info["rows"], report_errors(table), info["mine"], info["error_rows"])
            stats.add_commit_place(part.part_id, info["rows"], "worker", info["node"], info["committer"])
    elapsed = time.perf_counter() - start
    store.close()
    return {"seconds": round(elapsed, 4), "ms_per_part": round(1000 * elapsed / len(tasks), 3)}


def run_phases(spec: Path, output: str, trace: bool = False) -> dict:
    """`phases` in a fresh process (its own imports, no warm caches of this one)."""
    return _child(["_phases", str(spec), output] + (["--trace"] if trace else []))


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def submit(spec: Path, output: str, summary: Path) -> dict:
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", "submit", str(spec), "--set",
                           f"output.path={output}", "--summary-json", str(summary)],
                          capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    s = json.loads(summary.read_text())
    from datetime import datetime

    run_start = datetime.fromisoformat(s["started_at"].replace("Z", "+00:00")).timestamp()
    ttft = s.get("time_to_first_token_s")
    return {"wall_s": s["wall_seconds"], "process_wall_s": round(time.time() - start, 3),
            "time_to_first_token_s": ttft,
            "process_start_to_first_token_s": None if ttft is None else round(run_start + ttft - start, 3),
            "driver_peak_rss_mb": s["driver_peak_rss_mb"], "rows_this_run": s["rows"]["this_run"],
            "rows_per_s": round(s["rows"]["this_run"] / s["wall_seconds"], 1) if s["wall_seconds"] else None,
            "parts_this_run": s["parts"]["committed_this_run"], "parts_resumed": s["parts"]["resumed"]}


def uncommit_tail(output: Path, fraction: float) -> int:
    """Leave the output as a kill at (1 - fraction) of the job does: the last parts' markers and data
    objects and _SUCCESS removed. Returns how many parts were uncommitted."""
    markers = sorted((output / "_commits").glob("*.json"))
    tail = markers[len(markers) - max(1, round(len(markers) * fraction)):]
    for m in tail:
        for obj in json.loads(m.read_text())["objects"]:
            (output / obj["path"]).unlink()
        m.unlink()
    (output / "_SUCCESS").unlink()
    return len(tail)


def object_count(output: Path) -> dict:
    counts: dict[str, int] = {}
    for p in output.rglob("*"):
        if p.is_file():
            top = p.relative_to(output).parts[0] if len(p.relative_to(output).parts) > 1 else "(root)"
            counts[top] = counts.get(top, 0) + 1
    return {"total": sum(counts.values()), **dict(sorted(counts.items()))}


def run_case(rows: int, files: int, rows_per_part: int, workdir: Path, driver_parts: int,
             phases_only: bool = False, fmt: str = "jsonl") -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"scale-{rows}-{files}-", dir=workdir))
    try:
        t = time.perf_counter()
        data = write_input(root, rows, files, fmt)
        spec = write_spec(root, data, rows_per_part, fmt)
        case = {"rows": rows, "files": files, "rows_per_part": rows_per_part, "input_format": fmt,
                "input_mb": round(sum(p.stat().st_size for p in data.iterdir()) / 2**20, 1),
                "write_input_s": round(time.perf_counter() - t, 1)}
        fresh = str(root / "phases-out")
        case["phases_fresh"] = run_phases(spec, fresh)
        shutil.rmtree(fresh)
        case["phases_fresh"]["python_peak_mb"] = run_phases(spec, fresh, trace=True)["python_peak_mb"]
        shutil.rmtree(fresh)
        if phases_only:  # no submit: the listing/planning costs and the driver's per-part work only
            case["driver"] = _child(["_driver", str(spec), str(root / "driver-out"), str(driver_parts)])
            print(json.dumps(case), file=sys.stderr, flush=True)
            return case
        out = root / "out"
        case["submit"] = submit(spec, str(out), root / "s1.json")
        case["objects"] = object_count(out)
        case["uncommitted_parts"] = uncommit_tail(out, 0.1)
        case["phases_resume"] = run_phases(spec, str(out))
        case["resume"] = submit(spec, str(out), root / "s2.json")
        if driver_parts:
            case["driver"] = _child(["_driver", str(spec), str(root / "driver-out"), str(driver_parts)])
        print(json.dumps(case), file=sys.stderr, flush=True)
        return case
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_phases":
        print(json.dumps(phases(sys.argv[2], sys.argv[3], "--trace" in sys.argv)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_driver":
        print(json.dumps(driver_loop(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="*", default=[], help="row counts (input of --shards files)")
    p.add_argument("--shards", type=int, default=10, help="files of the --rows cases")
    p.add_argument("--files", type=int, nargs="*", default=[], help="file counts (--rows-per-file each)")
    p.add_argument("--rows-per-file", type=int, default=10)
    p.add_argument("--rows-per-part", type=int, default=1000)
    p.add_argument("--input-format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument("--driver-parts", type=int, default=100, help="parts of the driver measurement (0: off)")
    p.add_argument("--phases-only", action="store_true", help="skip the submit and resume runs")
    p.add_argument("--workdir", default=None, help="where inputs and outputs go (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the results (JSON) here")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [(n, args.shards) for n in args.rows] + [(f * args.rows_per_file, f) for f in args.files]
    results = {"machine": {"cpus": os.cpu_count(), "load_average_start": os.getloadavg()},
               "cases": [run_case(n, f, args.rows_per_part, workdir, args.driver_parts, args.phases_only,
                                  args.input_format) for n, f in cases]}
    results["machine"]["load_average_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
