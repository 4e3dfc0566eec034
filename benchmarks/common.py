"""Shared benchmark plumbing: repeated runs with medians and spread, per-step timing, JSON output.

Every benchmark here runs a warm-up, then `--runs` measured repetitions in one invocation, and reports the
median with min/max, because single runs on a shared GPU moved by ~10% between invocations (RESULTS.md).

`StepRecorder` wraps one engine's scheduler to time every step on the host (cheap, always on) and, under
`profiled()`, torch.profiler, so that the device kernels inside each step's window give the GPU busy
fraction per step. It only wraps an attribute, so the engine needs no hooks of its own; an engine without
`engine.scheduler.schedule` gets "available": false rather than wrong figures.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def spread(xs: list[float]) -> dict[str, Any]:
    """Median, min, max and the raw values of repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "runs": xs}


def add_rates(r: dict[str, Any], total_in: int, ceiling: float, share_key: str = "share_of_ceiling") -> None:
    """Out and total (prompt + output) tokens/s of every run of an arm; the median's share of `ceiling`."""
    secs = r["seconds"]["runs"]
    r["out_tok_s"] = spread([r["output_tokens"] / s for s in secs])
    r["total_tok_s"] = spread([(r["output_tokens"] + total_in) / s for s in secs])
    r[share_key] = r["total_tok_s"]["median"] / ceiling


def compare_arms(rows: dict[str, dict[str, Any]]) -> None:
    """Same-run ratios: every arm against HF generate, deterministic against fast (where both ran)."""
    if "hf" in rows:
        for r in rows.values():
            r["ratio_to_hf"] = r["out_tok_s"]["median"] / rows["hf"]["out_tok_s"]["median"]
    for d in [m for m in rows if m.startswith("deterministic")]:   # suffixed arms: bench_throughput.py
        f = "fast" + d.removeprefix("deterministic")
        if f in rows:
            det, fast = rows[d]["out_tok_s"]["median"], rows[f]["out_tok_s"]["median"]
            rows[d]["slowdown_vs_fast"] = 1 - det / fast


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()



def timed_generate(llm: Any, prompts: list, sp: Any, rec: StepRecorder) -> tuple[float, list]:
    """One `generate` of all `prompts` with `sp`, timed between device syncs, its steps closed in `rec`:
    (seconds, outputs)."""
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync()
    rec.end()
    return time.perf_counter() - t0, outs


def measure_runs(llm: Any, prompts: list, sp: Any, rec: StepRecorder, runs: int, out: JsonOut, arm: str
                 ) -> tuple[list[float], list[list[int]]]:
    """A full-size warm-up (every kernel and batch shape of the measured runs compiled once), then `runs`
    timed runs (`measured_run`). Returns (the runs' seconds, run 0's token ids per prompt)."""
    timed_generate(llm, prompts, sp, rec)
    rec.reset()
    seconds, first = [], None
    for i in range(runs):
        dt, toks = measured_run(llm, prompts, sp, rec, out, arm, i, first)
        seconds.append(dt)
        first = first or toks
    return seconds, first


def measured_run(llm: Any, prompts: list, sp: Any, rec: StepRecorder, out: JsonOut, arm: str, i: int,
                 first: list[list[int]] | None) -> tuple[float, list[list[int]]]:
    """Timed run `i` of `arm`, written as a JSON line: seconds, output tokens, whether its tokens are
    `first`'s, and where a slow run lost its time (its slowest steps, the time outside steps, the
    collector's pauses). Returns (seconds, token ids per prompt)."""
    done = len(rec.steps)
    with GcWatch() as gcw:
        dt, outs = timed_generate(llm, prompts, sp, rec)
    toks = [o.token_ids for o in outs]
    steps = rec.steps[done:]
    slowest = sorted(range(len(steps)), key=lambda j: -steps[j][1])[:3]
    out.line({"arm": arm, "run": i, "seconds": dt, "output_tokens": sum(map(len, toks)),
              "same_tokens_as_run0": first is None or toks == first,
              "slowest_steps": [(steps[j][0], j, round(1000 * steps[j][1], 2)) for j in slowest],
              "outside_steps_ms": round(1000 * (dt - sum(t for _, t in steps)), 2), "gc": gcw.summary()})
    return dt, toks


class GcWatch:
    """The cyclic collector's pauses (generation, ms) while the block runs (gc.callbacks)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], 1000 * (time.perf_counter() - self._t0)))

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """Collections and their ms per generation, the total ms and the longest pause."""
        by_gen = {g: [ms for gg, ms in self.pauses if gg == g] for g in (0, 1, 2)}
        return {"count": {f"gen{g}": len(v) for g, v in by_gen.items()},
                "ms": {f"gen{g}": round(sum(v), 2) for g, v in by_gen.items()},
                "gc_ms": round(sum(ms for _, ms in self.pauses), 2),
                "longest_ms": round(max((ms for _, ms in self.pauses), default=0.0), 2)}


def profiled_run(llm: Any, prompts: list, sp: Any, rec: StepRecorder) -> dict[str, Any]:
    """One more `generate` under torch.profiler: its seconds, the GPU busy fraction and host ms per step
    (by kind) and the top device kernels (`StepRecorder.profiled`)."""
    rec.reset()
    with rec.profiled():
        dt, _ = timed_generate(llm, prompts, sp, rec)
    return {"seconds": dt, "per_step": rec.gpu_busy, "top_kernels": rec.profile_table}


def measure_hf_runs(model: Any, ids_all: torch.Tensor, batch: int, output_len: int, runs: int, out: JsonOut
                    ) -> tuple[list[float], int]:
    """transformers' greedy `generate` over every row of `ids_all`, `batch` rows a call, exactly
    `output_len` new tokens each: a full-size warm-up, then `runs` timed runs, each a JSON line (arm "hf").
    Call under torch.no_grad(). Returns (the runs' seconds, output tokens of one run)."""
    def one() -> tuple[float, int]:
        sync()
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, ids_all.shape[0], batch):
            ids = ids_all[i:i + batch]
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                               min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            n_out += (o.shape[1] - ids.shape[1]) * ids.shape[0]
        sync()
        return time.perf_counter() - t0, n_out

    one()  # full-size warm-up, as for deepinfer
    seconds, n_out = [], 0
    for i in range(runs):
        dt, n_out = one()
        seconds.append(dt)
        out.line({"arm": "hf", "run": i, "seconds": dt, "output_tokens": n_out})
    return seconds, n_out

class JsonOut:
    """Writes each record as one JSON line to stdout and to `<out>.jsonl`, and the summary to `<out>`."""

    def __init__(self, out: str | None) -> None:
        self.out = Path(out) if out else None
        self.lines = self.out.with_suffix(self.out.suffix + ".jsonl").open("w") if self.out else None

    def line(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, default=str)
        print(text, flush=True)
        if self.lines:
            self.lines.write(text + "\n")
            self.lines.flush()

    def summary(self, report: dict[str, Any]) -> None:
        print(json.dumps(report, indent=1, default=str), flush=True)
        if self.out:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(report, indent=1, default=str))
        if self.lines:
            self.lines.close()
            self.lines = None


class StepRecorder:
    """Host time of every engine step (and, profiling, the GPU busy fraction of each), split by kind.

    It wraps `engine.scheduler.schedule`, which both the synchronous and the overlapped engine loop call
    once per step: a step's window runs from one `schedule()` call to the next (the last one ends at
    `end()`), i.e. the host's cadence per step, device waits included. A step is "decode" when every
    scheduled sequence runs exactly one new token, else "prefill" (mixed steps included).
    """

    MARK = "bench_step_mark"

    def __init__(self, llm: Any, profile: bool = False) -> None:
        sched = getattr(getattr(llm, "engine", None), "scheduler", None)
        self.available = sched is not None and hasattr(sched, "schedule")
        self.profile = profile
        self.marks: list[tuple[str, float]] = []
        self.steps: list[tuple[str, float]] = []
        self.gpu_busy: dict[str, Any] = {"available": False}
        self.profile_table = ""
        if self.available:
            self._wrap(sched)

    def _wrap(self, sched: Any) -> None:
        inner = sched.schedule

        def schedule() -> Any:
            out = inner()
            scheduled = getattr(out, "scheduled", None) or []
            decode = bool(scheduled) and all(getattr(s, "num_new_tokens", 0) == 1 for s in scheduled)
            self._mark("decode" if decode else "prefill")
            return out

        sched.schedule = schedule

    def _mark(self, kind: str) -> None:
        if self.profile:
            with torch.profiler.record_function(self.MARK):
                pass
        self.marks.append((kind, time.perf_counter()))

    def end(self) -> None:
        """Close the last step's window (call right after generate returns, device synchronised)."""
        if self.marks:
            self._mark("end")
            self.steps.extend((k, t1 - t0) for (k, t0), (_, t1) in zip(self.marks, self.marks[1:]))
            self.marks.clear()

    def reset(self) -> None:
        self.marks.clear()
        self.steps.clear()

    def host_summary(self) -> dict[str, Any]:
        """Per kind: step count, total seconds, median/min/max host ms per step."""
        if not self.available:
            return {"available": False}
        out: dict[str, Any] = {}
        for k in ("decode", "prefill"):
            ms = [1000 * dt for kind, dt in self.steps if kind == k]
            if ms:
                per = spread(ms)
                del per["runs"]
                out[k] = {"steps": len(ms), "seconds": sum(ms) / 1000, "host_ms_per_step": per}
        return out

    @contextmanager
    def profiled(self):
        """Run the body under torch.profiler (CPU + CUDA); then `gpu_busy` holds per-step figures.

        Call `end()` inside the body, after the run, so the last step's window closes under the profiler.
        """
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        start = len(self.steps)
        was, self.profile = self.profile, True
        try:
            with profile(activities=acts) as prof:
                yield prof
        finally:
            self.profile = was
        self.gpu_busy = gpu_busy_per_step(prof, [k for k, _ in self.steps[start:]], self.MARK)
        self.profile_table = prof.key_averages().table(
            sort_by="cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
            row_limit=25, max_name_column_width=60)


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def gpu_busy_per_step(prof: Any, kinds: list[str], mark: str) -> dict[str, Any]:
    """Fraction of each step's window during which at least one device kernel ran, by step kind.

    Windows run between consecutive `mark` events (profiler clock, shared with the device timestamps).
    """
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.name == mark)
    windows = list(zip(starts, starts[1:]))
    device_events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    kernels = merge_intervals([(e.time_range.start, e.time_range.end) for e in device_events])
    if not kernels or len(windows) != len(kinds):
        return {"available": False, "windows": len(windows), "steps": len(kinds), "kernels": len(kernels)}
    per_kind: dict[str, list[tuple[float, float]]] = {}
    for (s, e), kind in zip(windows, kinds):
        busy = sum(min(e, ke) - max(s, ks) for ks, ke in kernels if ke > s and ks < e)
        per_kind.setdefault(kind, []).append((busy, e - s))
    out: dict[str, Any] = {"available": True}
    top = _kernels_by_kind(device_events, starts, kinds)
    for kind, rows in per_kind.items():
        fracs = spread([b / w for b, w in rows if w > 0])
        del fracs["runs"]
        out[kind] = {"steps": len(rows), "busy_fraction": fracs,
                     "gpu_ms_per_step_median": statistics.median(b / 1000 for b, _ in rows),
                     "host_ms_per_step_median": statistics.median(w / 1000 for _, w in rows),
                     "busy_fraction_overall": sum(b for b, _ in rows) / max(1e-9, sum(w for _, w in rows)),
                     "top_kernels_us_per_step": top.get(kind, {})}
    return out


def _kernels_by_kind(device_events: list, starts: list[float], kinds: list[str], limit: int = 20
                     ) -> dict[str, dict[str, float]]:
    """Per step kind, the device kernels taking the most time: µs per step of that kind, by name (a kernel
    counts for the step whose window it starts in)."""
    import bisect

    totals: dict[str, dict[str, float]] = {}
    for ev in device_events:
        i = bisect.bisect_right(starts, ev.time_range.start) - 1
        if 0 <= i < len(kinds):
            by_name = totals.setdefault(kinds[i], {})
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.time_range.end - ev.time_range.start
    steps = {k: kinds.count(k) for k in set(kinds)}
    return {kind: {name[:80]: round(us / steps[kind], 1)
                   for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:limit]}
            for kind, by_name in totals.items()}


def finish_sweep(rows: list[dict[str, Any]], out: str | Path | None, started: float) -> int:
    """End a kernel sweep: print its wall time and device, write its rows as JSON to `out` (when given) with
    the device and torch version they were measured on; 0, the script's exit status."""
    print(f"total {time.time() - started:.0f} s on {torch.cuda.get_device_name()}")
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0
