"""Garbage-collector pauses inside engine runs, with and without `quiet_gc` (engine/core/gc_scope.py).

Runs the real engine on CPU over the near-free model of bench_host_step.py (a 1-layer Qwen2 shape with a
real byte-level BPE), so a run is mostly host work as a small model's run is on the GPU host, and records
every cyclic-collector pause (gc.callbacks) inside each `generate`: how many per generation, their total and
the longest, and the run's wall time. The two arms alternate run by run ("quiet": the engine as shipped;
"plain": `quiet_gc` replaced by a no-op in this process), after one warm-up run each.

    python3 benchmarks/gc_pauses.py --runs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from common import GcWatch


def one_run(llm, prompts, params) -> dict:
    t0 = time.perf_counter()
    with GcWatch() as watch:
        llm.generate(prompts, params, use_tqdm=False)
    return {"wall_s": time.perf_counter() - t0, **watch.summary()}


def main() -> None:
    from bench_host_step import add_workload_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=5, help="measured runs per arm, alternating")
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from bench_host_step import tiny_llm, workload
    from deepinfer.engine import SamplingParams
    from deepinfer.engine.core import engine_core

    d, prompts = workload(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = tiny_llm(d, args)
    shipped = engine_core.quiet_gc
    arms = {"quiet": shipped, "plain": contextlib.nullcontext}
    results: dict[str, list[dict]] = {a: [] for a in arms}
    for i in range(args.runs + 1):   # round 0 warms both arms up
        for arm, scope in arms.items():
            engine_core.quiet_gc = scope
            r = one_run(llm, prompts, params)
            if i:
                results[arm].append(r)
                print(json.dumps({"arm": arm, "run": i, **r}), flush=True)
    engine_core.quiet_gc = shipped
    summary = {"config": vars(args)}
    for arm, rs in results.items():
        summary[arm] = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "gc_ms", "longest_ms")}
        summary[arm]["wall_s_min_max"] = [min(r["wall_s"] for r in rs), max(r["wall_s"] for r in rs)]
        summary[arm]["gen2_collections"] = sum(r["count"]["gen2"] for r in rs)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
