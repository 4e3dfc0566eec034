"""`deepinfer-job plan SPEC`: what a submit would do, from the input and the tokenizer alone (no weights).

It runs the submit's own CPU stages over every part — list the input, cut it into parts, mark duplicate
ids (stages/dedupe.py), read, render prompts, tokenize (stages/plan.prepare_part) — so the rows it says
would be quarantined are exactly the rows a submit quarantines before generation (a missing or null
column, a prompt too long for the model, a duplicate id, an undecodable line). Rows can still be
quarantined during generation (an output_schema violation, a truncated JSON); plan cannot predict those.

Token figures are over the rows that would run. Percentiles use the nearest-rank rule (the smallest value
with at least p% of the rows at or below it). The output-token bound is rows x sampling.max_tokens x
sampling.n (a Batch body's own max_tokens and n for its row). The engine-hour estimate uses the measured
rates of plan_rates.py for the model's shape, and says so when the shape was never measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deepinfer.pipeline.spec.load import JobSpec

MAX_EXAMPLES = 5  # row ids listed per quarantine code


def percentile(sorted_values: list[int], p: float) -> int:
    """Nearest-rank percentile of ascending values (0 for none)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def _token_stats(lengths: list[int]) -> dict[str, int]:
    values = sorted(lengths)
    return {"total": sum(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": values[-1] if values else 0}


def _estimate(model_dir: str, prompt_tokens: int, output_tokens: int, points: int = 1) -> dict[str, Any]:
    from deepinfer.pipeline.plan_rates import engine_hours, model_shape, rates_for

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    shape = model_shape(config)
    rates = [{**r, "engine_hours": points * engine_hours(r, prompt_tokens, output_tokens)}
             for r in rates_for(shape)]
    note = None if rates else ("no measured rate for this model shape in deepinfer.pipeline.plan_rates; "
                               "engine-hours not estimated")
    return {"shape": shape, "rates": rates, "note": note}


def plan_spec(spec: JobSpec) -> dict[str, Any]:
    """The plan of `spec`'s job as a JSON-serializable dict (what `plan --json` prints)."""
    from deepinfer.pipeline.runner import check_model, part_tasks, plan_job
    from deepinfer.pipeline.stages.dedupe import mark_duplicates
    from deepinfer.pipeline.stages.plan import StagePlan, prepare_part
    from deepinfer.pipeline.stages.prompt import model_max_len
    from deepinfer.pipeline.stages.read import list_input

    model_dir = check_model(spec)  # tokenizer and config only: weights are never loaded
    rows_per_part = spec.runtime.rows_per_part
    listing = list_input(spec.input.path, spec.input.format, spec.input.storage_options,
                         stride=rows_per_part, on_bad_file=spec.input.on_bad_file)
    planned = plan_job(listing, rows_per_part)
    tasks = mark_duplicates(spec, listing, part_tasks(listing, planned))
    stage_plan = StagePlan.from_spec(spec)
    lengths: list[int] = []
    bounds: list[int] = []  # per row: max_tokens x n (a Batch body's own values where it sets them)
    quarantined: dict[str, dict[str, Any]] = {}
    for task in tasks:
        table = prepare_part(stage_plan, task)
        cols = {n: table.column(n).to_pylist() for n in ("__row_id", "__plen", "__err_stage", "__err_code",
                                                         "__err_msg", "__file", "__row", "__aux")}
        # prepare_part sorts by length; examples are listed in input order
        for i in sorted(range(table.num_rows), key=lambda i: (cols["__file"][i], cols["__row"][i])):
            code = cols["__err_code"][i]
            if code is None:
                lengths.append(int(cols["__plen"][i]))
                params = (json.loads(cols["__aux"][i]) if cols["__aux"][i] else {}).get("params") or {}
                bounds.append(params.get("max_tokens", spec.sampling.max_tokens)
                              * params.get("n", spec.sampling.n))
                continue
            entry = quarantined.setdefault(code, {"stage": cols["__err_stage"][i], "rows": 0,
                                                  "examples": [], "message": cols["__err_msg"][i]})
            entry["rows"] += 1
            if len(entry["examples"]) < MAX_EXAMPLES:
                entry["examples"].append(cols["__row_id"][i])
    max_tokens = spec.sampling.max_tokens
    max_len = model_max_len(model_dir, spec.model.max_model_len)
    prompt = _token_stats(lengths)
    output_bound = sum(bounds)
    points = 1
    if spec.sweep is not None:
        from deepinfer.pipeline.sweep import point_specs

        points = len(point_specs(spec))
    return {
        "sweep_points": points,
        "spec_model": spec.model.ref, "model_dir": str(model_dir), "max_model_len": max_len,
        "input": {"path": spec.input.path, "files": len(listing), "parts": len(planned),
                  "rows_per_part": rows_per_part},
        "rows": {"total": sum(t.num_rows for t in tasks), "would_run": len(lengths),
                 "quarantined": sum(e["rows"] for e in quarantined.values())},
        "prompt_tokens": prompt,
        "output_tokens_bound": output_bound, "max_tokens": max_tokens,
        "rows_over_max_model_len": sum(1 for n in lengths if n + max_tokens > max_len),
        "quarantined": dict(sorted(quarantined.items())),
        "estimate": _estimate(str(model_dir), prompt["total"], output_bound, points),
    }


def _per_row_note(plan: dict[str, Any]) -> str:
    """Where the bound is not rows x max_tokens (sampling.n, or Batch rows with their own values)."""
    plain = plan["rows"]["would_run"] * plan["max_tokens"]
    return "" if plan["output_tokens_bound"] == plain else " x n, or each row's own max_tokens and n"


def render_plan(plan: dict[str, Any]) -> str:
    """The plan as the lines `deepinfer-job plan` prints."""
    rows, prompt, inp = plan["rows"], plan["prompt_tokens"], plan["input"]
    lines = [
        f"model: {plan['spec_model']} ({plan['model_dir']}), max_model_len {plan['max_model_len']:,}",
        f"input: {inp['path']}: {inp['files']} file(s), {inp['parts']} part(s) of up to "
        f"{inp['rows_per_part']:,} rows",
        f"rows: {rows['total']:,} total, {rows['would_run']:,} would run, {rows['quarantined']:,} would be "
        "quarantined before generation",
        f"prompt tokens: {prompt['total']:,} total; p50 {prompt['p50']:,}, p90 {prompt['p90']:,}, "
        f"p99 {prompt['p99']:,}, max {prompt['max']:,}",
        f"output tokens: at most {plan['output_tokens_bound']:,} ({rows['would_run']:,} rows x max_tokens "
        f"{plan['max_tokens']:,}{_per_row_note(plan)})",
    ]
    if plan["rows_over_max_model_len"]:
        lines.append(f"  {plan['rows_over_max_model_len']:,} rows have prompt + max_tokens > max_model_len: "
                     "they cannot generate max_tokens tokens")
    if plan["quarantined"]:
        lines.append("would be quarantined (errors/):")
        for code, e in plan["quarantined"].items():
            lines.append(f"  {code} (stage {e['stage']}): {e['rows']:,} rows, e.g. "
                         f"{', '.join(map(str, e['examples']))} — {e['message']}")
    lines.append("  (generation can quarantine more: output_schema mismatches, truncated JSON)")
    if plan["sweep_points"] > 1:
        lines.append(f"sweep: {plan['sweep_points']} points; the figures above are per point (the sweep's "
                     "base settings) and the estimates below are for all points")
    est = plan["estimate"]
    if est["note"]:
        shape = ", ".join(f"{k}={v}" for k, v in est["shape"].items())
        lines.append(f"estimate: {est['note']} ({shape})")
    for r in est["rates"]:
        what = "output" if r["counts"] == "output" else "prompt + output"
        cond = f", {r['conditions']}" if r["conditions"] else ""
        lines.append(f"estimate: {r['engine_hours']:.3g} engine-hours on {r['hardware']} at "
                     f"{r['tokens_per_s']:,} {what} tok/s ({r['name']} shape{cond}, measured "
                     f"{r['measured']}); an upper bound: every row generating max_tokens")
    return "\n".join(lines)
