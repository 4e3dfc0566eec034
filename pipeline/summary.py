"""Run statistics and the run summary (schemas/summary.schema.json)."""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.startup_clock import (  # noqa: F401 - re-exported (the stages, tests)
    ENGINE_MARKS,
    StartupClock,
    process_started_epoch,
)


def peak_rss_mb() -> float:
    """Peak resident memory of this (driver) process so far, in MiB: what a job's size must not grow."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class EngineSpec:
    """One engine's MTP speculative-decoding figures in this run: sums of the per-call deltas its rows
    carry (`__spec`, stages/generate.py) and its latest state. Drafting, once turned off, stays off for
    the engine's life, so `active` is AND-ed and a reason kept: right whatever order batches arrive in."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    enabled: bool = False
    active: bool = True
    disabled_reason: str | None = None
    estimated_speedup: float = 0.0
    _latest: int = -1  # the engine's cumulative verify steps at the snapshot the speed-up comes from

    def add(self, figures: dict[str, Any]) -> None:
        self.drafted += figures["drafted"]
        self.accepted += figures["accepted"]
        self.verify_steps += figures["verify_steps"]
        self.enabled = self.enabled or figures["enabled"]
        self.active = self.active and figures["active"]
        self.disabled_reason = self.disabled_reason or figures["disabled_reason"]
        if figures["verify_steps_total"] >= self._latest:
            self._latest = figures["verify_steps_total"]
            self.estimated_speedup = figures["estimated_speedup"]

    def entry(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "active": self.enabled and self.active,
                "disabled_reason": self.disabled_reason, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "verify_steps": self.verify_steps,
                **_rates(self.drafted, self.accepted, self.verify_steps),
                "estimated_speedup": round(self.estimated_speedup, 6)}


def _rates(drafted: int, accepted: int, verify_steps: int) -> dict[str, float]:
    per_step = accepted / verify_steps if verify_steps else 0.0
    return {"acceptance_rate": round(accepted / drafted, 6) if drafted else 0.0,
            "mean_accepted_tokens_per_step": round(per_step, 6),
            "mean_tokens_per_verify_step": round(1.0 + per_step, 6) if verify_steps else 0.0}


def speculative_section(engines: dict[str, EngineSpec]) -> dict[str, Any]:
    """The summary's `speculative` section: totals over the engines, then each engine. The speed-up is
    each engine's own estimate (LLM.get_stats, over its life), weighted by its verify steps this run."""
    drafted = sum(e.drafted for e in engines.values())
    accepted = sum(e.accepted for e in engines.values())
    steps = sum(e.verify_steps for e in engines.values())
    speedup = sum(e.estimated_speedup * e.verify_steps for e in engines.values()) / steps if steps else 0.0
    reasons = [e.disabled_reason for _, e in sorted(engines.items()) if e.disabled_reason]
    return {
        "enabled": any(e.enabled for e in engines.values()),
        "active": any(e.enabled and e.active for e in engines.values()),
        "disabled_reason": reasons[0] if reasons else None,
        "drafted_tokens": drafted, "accepted_tokens": accepted, "verify_steps": steps,
        **_rates(drafted, accepted, steps), "estimated_speedup": round(speedup, 6),
        "engines": [{"engine": name, **e.entry()} for name, e in sorted(engines.items())],
    }


# Parts the summary lists one by one (where each was committed); the per-node counts cover them all.
COMMITS_LISTED = 1000


@dataclass
class RunStats:
    """Counts for one run. Row and part counts grow only when a part is committed — by this run (its
    own counts) or, racing, by another run (counted apart) — so that a summary counts only what its run
    committed; token and engine figures count the work this run did."""

    rows_total: int
    parts_total: int
    rows_resumed: int = 0
    parts_resumed: int = 0
    ok_resumed: int = 0
    errored_resumed: int = 0
    rows_ok: int = 0
    rows_errored: int = 0
    parts_committed: int = 0
    parts_by_others: int = 0
    ok_by_others: int = 0
    errored_by_others: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    by_stage: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    engines: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))
    numerics: dict[str, str] = field(default_factory=dict)  # engine -> its stack (output/numerics.py)
    spec: dict[str, EngineSpec] = field(default_factory=lambda: defaultdict(EngineSpec))
    started_at: str = field(default_factory=utc_now)
    start: float = field(default_factory=time.monotonic)
    start_epoch: float = field(default_factory=time.time)
    first_token_epoch: float | None = None
    first_commit: float | None = None  # time.monotonic() of this run's first commit
    # (where, node) -> [parts, rows] this run committed there; the first COMMITS_LISTED of those parts
    committed_on: dict[tuple[str, str | None], list[int]] = field(default_factory=dict)
    commit_log: list[dict[str, Any]] = field(default_factory=list)
    clock: StartupClock = field(default_factory=StartupClock)
    executor: dict[str, str] | None = None  # executors/choice.ExecutorChoice.section(): what ran, and why

    def add_batch(self, batch: pa.Table) -> tuple[int, int]:
        """Count the work in a batch of ENGINE_SCHEMA rows; returns (rows, output tokens) for progress."""
        names = ["__plen", "__ntok", "__engine", "__gen_s"]
        names += [n for n in ("__spec", "__numerics") if n in batch.schema.names]
        rows = batch.select(names).to_pylist()
        out_tokens = 0
        for r in rows:
            figures = json.loads(r["__spec"]) if r.get("__spec") is not None else {}
            if "drafted" in figures and r["__engine"] is not None:
                self.spec[r["__engine"]].add(figures)
            if "timing" in figures:
                self.clock.add(figures["timing"])
            ntok = r["__ntok"] or 0
            out_tokens += ntok
            if r["__engine"] is not None:
                if r.get("__numerics") is not None:
                    self.numerics[r["__engine"]] = r["__numerics"]
                e = self.engines[r["__engine"]]
                e[0] += 1
                e[1] += ntok
                e[2] += r["__gen_s"] or 0.0
                self.prompt_tokens += r["__plen"] or 0
        first = pc.min(batch.column("__t_first")).as_py() if "__t_first" in batch.schema.names else None
        if first is not None and (self.first_token_epoch is None or first < self.first_token_epoch):
            self.first_token_epoch = first
        self.output_tokens += out_tokens
        return len(rows), out_tokens

    def add_commit(self, ok_rows: int, errors: pa.Table, mine: bool, error_rows: int | None = None) -> None:
        """Count a committed part: `errors` (ERROR_SCHEMA) when this run committed it (`mine`), else the
        winning run's counts (`ok_rows`, `error_rows`)."""
        if not mine:
            self.parts_by_others += 1
            self.ok_by_others += ok_rows
            self.errored_by_others += errors.num_rows if error_rows is None else error_rows
            return
        if self.first_commit is None:
            self.first_commit = time.monotonic()
        self.parts_committed += 1
        self.rows_ok += ok_rows
        self.rows_errored += errors.num_rows
        for stage, code in zip(errors.column("stage").to_pylist(), errors.column("code").to_pylist()):
            self.by_stage[stage][code] += 1

    def add_commit_place(self, part_id: str, rows: int, where: str, node: str | None,
                         committer: str | None) -> None:
        """Where a part this run committed was committed (summary `commits`): on a worker or the driver."""
        counts = self.committed_on.setdefault((where, node), [0, 0])
        counts[0] += 1
        counts[1] += rows
        if len(self.commit_log) < COMMITS_LISTED:
            self.commit_log.append({"part": part_id, "where": where, "node": node, "committer": committer})

    def commits_section(self) -> dict[str, Any]:
        places = sorted(self.committed_on.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
        by_node = [{"where": w, "node": n, "parts": v[0], "rows": v[1]} for (w, n), v in places]
        return {"by_node": by_node, "parts": list(self.commit_log), "parts_listed_max": COMMITS_LISTED}

    @property
    def errored_total(self) -> int:
        return self.errored_resumed + self.rows_errored + self.errored_by_others

    def error_fraction(self) -> float:
        return self.errored_total / self.rows_total if self.rows_total else 0.0

    def _commit_s(self) -> float | None:
        return None if self.first_commit is None else self.first_commit - self.start

    def _startup(self) -> dict[str, float | None]:
        ttft = None if self.first_token_epoch is None else max(self.first_token_epoch - self.start_epoch, 0.0)
        ttfc = None if self.first_commit is None else self.first_commit - self.start
        return {"time_to_first_token_s": None if ttft is None else round(ttft, 3),
                "time_to_first_commit_s": None if ttfc is None else round(ttfc, 3)}

    def summary(self, *, job: str | None, output: str, fingerprint: str | None, max_fraction: float,
                exit_code: int) -> dict[str, Any]:
        wall = time.monotonic() - self.start
        from deepinfer.pipeline.version import __version__

        engines = [
            {"engine": name, "rows": int(v[0]), "output_tokens": int(v[1]), "busy_seconds": round(v[2], 6),
             "output_tokens_per_second": round(v[1] / v[2], 3) if v[2] > 0 else 0.0,
             **({"numerics": self.numerics[name]} if name in self.numerics else {})}
            for name, v in sorted(self.engines.items())
        ]
        return {
            "job": job, "output": output, "fingerprint": fingerprint,
            "status": "succeeded" if exit_code == 0 else "error_budget_exceeded", "exit_code": exit_code,
            "deepinfer_version": __version__, "started_at": self.started_at, "finished_at": utc_now(),
            "wall_seconds": round(wall, 3), **self._startup(), "driver_peak_rss_mb": peak_rss_mb(),
            **({"executor": dict(self.executor)} if self.executor is not None else {}),
            "startup": self.clock.section(self.start_epoch, self.first_token_epoch, self._commit_s(), wall),
            "rows": {"total": self.rows_total, "ok": self.ok_resumed + self.rows_ok + self.ok_by_others,
                     "errored": self.errored_total, "this_run": self.rows_ok + self.rows_errored,
                     "resumed": self.rows_resumed},
            "parts": {"total": self.parts_total, "committed_this_run": self.parts_committed,
                      "resumed": self.parts_resumed},
            "committed_by_others": {"parts": self.parts_by_others,
                                    "rows": self.ok_by_others + self.errored_by_others},
            "commits": self.commits_section(),
            "tokens": {"prompt": self.prompt_tokens, "output": self.output_tokens,
                       "output_per_second": round(self.output_tokens / wall, 3) if wall > 0 else 0.0},
            "errors": {"fraction": round(self.error_fraction(), 6), "max_fraction": max_fraction,
                       "by_stage": {s: dict(sorted(c.items())) for s, c in sorted(self.by_stage.items())}},
            "engines": engines,
            "speculative": speculative_section(self.spec),
        }


def nothing_to_do(stored: dict, stats: RunStats) -> dict:
    """The summary of a submit that found its job complete: the job's totals from the run that completed
    it (`stored`), and this call's own figures (`stats`' times): nothing committed, generated or started,
    every part and row resumed."""
    rows, parts = stored["rows"], stored["parts"]
    return {
        **stored, "started_at": stats.started_at, "finished_at": utc_now(),
        "wall_seconds": round(time.monotonic() - stats.start, 3),
        "time_to_first_token_s": None, "time_to_first_commit_s": None, "startup": {},
        "rows": {**rows, "this_run": 0, "resumed": rows["ok"] + rows["errored"]},
        "parts": {**parts, "committed_this_run": 0, "resumed": parts["total"]},
        "committed_by_others": {"parts": 0, "rows": 0},
        "commits": {**stored["commits"], "by_node": [], "parts": []},
        "tokens": {"prompt": 0, "output": 0, "output_per_second": 0.0},
        "engines": [], "speculative": speculative_section({}),
        "driver_peak_rss_mb": round(peak_rss_mb(), 1),
    }


def validate_summary(summary: dict) -> None:
    """Raise jsonschema.ValidationError if `summary` breaks schemas/summary.schema.json (a bug)."""
    from deepinfer.pipeline.spec.schema import load_schema
    from jsonschema import Draft202012Validator

    Draft202012Validator(load_schema("summary.schema.json")).validate(summary)


def format_summary(s: dict) -> str:
    """Human-readable end-of-run report."""
    rows, tok, err = s["rows"], s["tokens"], s["errors"]
    lines = [
        f"deepinfer job {s['job'] or ''} -> {s['output']}: {s['status']} (exit {s['exit_code']})",
        f"  rows      {rows['ok']} ok, {rows['errored']} errored of {rows['total']} "
        f"({rows['this_run']} this run, {rows['resumed']} resumed)",
        f"  parts     {s['parts']['committed_this_run']} committed this run, "
        f"{s['parts']['resumed']} resumed, "
        + (f"{s['committed_by_others']['parts']} by a racing run, "
           if s.get("committed_by_others", {}).get("parts") else "")
        + f"{s['parts']['total']} total",
        f"  tokens    {tok['prompt']} in, {tok['output']} out, {tok['output_per_second']:.1f} out tok/s",
        f"  errors    {err['fraction']:.2%} of rows (budget {err['max_fraction']:.2%})",
        f"  wall time {s['wall_seconds']:.1f}s (first token {_secs(s.get('time_to_first_token_s'))}, "
        f"first commit {_secs(s.get('time_to_first_commit_s'))})",
    ]
    if s.get("executor"):
        lines.append(f"  executor  {s['executor']['name']} ({s['executor']['reason']})")
    up = s.get("startup") or {}
    if up.get("model_loaded_s") is not None:
        lines.append(f"  startup   engine started {_secs(up.get('engine_actor_started_s'))}, model loaded "
                     f"{_secs(up['model_loaded_s'])}, first part {_secs(up.get('first_part_received_s'))}; "
                     f"engines waited {up['engine_wait_s']:.1f}s for parts, "
                     f"committed {up['engine_commit_s']:.1f}s")
    if up.get("engine_preload_started_s") is not None:  # the local executor's (executors/engine_preload.py)
        marks = [_secs(up.get(f"engine_preload_{k}_s")) for k in ("started", "native", "cuda", "triton")]
        lines.append(f"  preload   from {marks[0]}: libraries {marks[1]}, CUDA {marks[2]}, Triton "
                     f"{marks[3]}; engine imported {_secs(up.get('engine_imported_s'))}")
    for stage, codes in err["by_stage"].items():
        lines.append(f"    {stage}: " + ", ".join(f"{c} x{n}" for c, n in codes.items()))
    for e in s["engines"]:
        lines.append(f"  engine {e['engine']}: {e['rows']} rows, {e['output_tokens']} tokens, "
                     f"{e['output_tokens_per_second']:.1f} tok/s while busy")
    for stack in sorted({e["numerics"] for e in s["engines"] if e.get("numerics")}):
        lines.append(f"  numerics  {stack}")
    spec = s.get("speculative") or {}
    if spec.get("drafted_tokens"):
        lines.append(f"  mtp       {spec['drafted_tokens']} drafted, {spec['accepted_tokens']} accepted "
                     f"({spec['acceptance_rate']:.1%}), {spec['mean_accepted_tokens_per_step']:.2f} accepted "
                     f"per verify step, estimated speed-up {spec['estimated_speedup']:.2f}x"
                     + (f"; turned off: {spec['disabled_reason']}" if spec["disabled_reason"] else ""))
    return "\n".join(lines)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"
