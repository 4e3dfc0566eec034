"""Where a prefill step's wall time goes when the GPU is not busy: a torch.profiler trace of prefill-only runs
(every prompt, one output token) per mode, and its GPU idle gaps attributed to the host code running then.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python3 benchmarks/prefill_timeline.py --shape qwen2.5-0.5b --out prefill_tl

Per mode it prints the run's wall time, the GPU busy time (union of kernel, copy and memset intervals), the
idle time between the first and the last kernel, and the idle gaps longer than --min-gap-us grouped by the
innermost Python frames on the host's main thread at the middle of each gap (with_stack traces): the code
that kept the device waiting. `--out X` also writes each trace to X.<mode>.json for a closer look.

A profiler with Python stacks slows the host several times over, so its gaps overstate host costs;
`--host-split` instead times, without a profiler, one more run with the engine's host phases and every Ops
call (the kernel launches) wrapped in wall-clock counters: ms per run and calls, inclusive (a phase
contains the launches it makes). On a host-bound run these add up to the wall time; the launches' times are
what each kernel costs the host to launch.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_throughput import random_prompts
from common import merge_intervals
from shapes import write_shape

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _main_thread_frames(events: list[dict]) -> list[dict]:
    """python_function events of the thread that launched most kernels (the engine's loop)."""
    launches = collections.Counter(e["tid"] for e in events if e.get("cat") == "cuda_runtime")
    tid = launches.most_common(1)[0][0] if launches else None
    return [e for e in events if e.get("cat") == "python_function" and e.get("tid") == tid]


def _stack_at(frames: list[dict], starts: list[float], t: float, depth: int) -> tuple[str, ...]:
    """The innermost `depth` frames covering time t (frames sorted by start)."""
    hi = bisect.bisect_right(starts, t)
    covering = [f for f in frames[max(0, hi - 4000):hi] if f["ts"] + f.get("dur", 0) >= t]
    covering.sort(key=lambda f: (f["ts"], -f.get("dur", 0)))
    names = [f["name"] for f in covering if "site-packages/torch/" not in f["name"]]
    return tuple(names[-depth:]) if names else ("<no python frame>",)


def analyze(trace: dict, min_gap_us: float, depth: int, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS]
    busy = merge_intervals(gpu)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    frames = sorted(_main_thread_frames(events), key=lambda f: f["ts"])
    starts = [f["ts"] for f in frames]
    by_stack: dict[tuple[str, ...], list[float]] = collections.defaultdict(list)
    for (_, e0), (s1, _) in zip(busy, busy[1:]):
        gap = s1 - e0
        if gap >= min_gap_us:
            by_stack[_stack_at(frames, starts, (e0 + s1) / 2, depth)].append(gap)
    rows = sorted(((sum(g), len(g), k) for k, g in by_stack.items()), reverse=True)[:top]
    return {"span_ms": span / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": (span - busy_us) / 1e3,
            "gaps_ms": sum(sum(g) for g in by_stack.values()) / 1e3,
            "top": [{"ms": round(t / 1e3, 3), "count": n, "stack": list(k)} for t, n, k in rows]}


def _host_split(run) -> dict:
    """Wall-clock ms and calls per wrapped host function over one `run()`, no profiler."""
    import deepinfer.kernels.paged_attention as pa
    from deepinfer.engine.core.scheduler import Scheduler
    from deepinfer.engine.layers.cuda_ops import CudaFastOps, CudaInvariantOps
    from deepinfer.engine.runner.model_runner import ModelRunner
    from deepinfer.engine.runner.step_executor import SampledTokens, StepExecutor

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    patched: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, label: str) -> None:
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                rec = totals[label]
                rec[0] += time.perf_counter() - t0
                rec[1] += 1
        patched.append((owner, name, fn))
        setattr(owner, name, timed)

    for name in ("schedule", "commit_launch", "update"):
        wrap(Scheduler, name, f"Scheduler.{name}")
    wrap(StepExecutor, "forward", "StepExecutor.forward (prepare + launches)")
    wrap(StepExecutor, "sample", "StepExecutor.sample")
    wrap(SampledTokens, "resolve", "SampledTokens.resolve (waits for the device)")
    wrap(ModelRunner, "prepare", "ModelRunner.prepare")
    wrap(pa, "build_plan", "paged_attention.build_plan")
    for cls in (CudaInvariantOps, CudaFastOps):
        for klass in cls.__mro__:
            for name, value in list(vars(klass).items()):
                if not name.startswith("_") and callable(value) and name not in cls.__dict__:
                    setattr(cls, name, value)     # a class-level copy to wrap without touching the base
        for name, value in list(vars(cls).items()):
            if not name.startswith("_") and callable(value):
                wrap(cls, name, f"ops.{name}")
    try:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
    rows = sorted(((v[0], v[1], k) for k, v in totals.items()), reverse=True)
    return {"wall_ms": wall * 1e3, "rows": [{"name": k, "ms": round(t * 1e3, 2), "calls": n,
                                              "us_per_call": round(t * 1e6 / max(n, 1), 1)}
                                             for t, n, k in rows]}


def run_mode(model_dir: Path, prompts: list, deterministic: bool, args: argparse.Namespace) -> dict:
    from deepinfer.engine import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy",
              deterministic=deterministic, max_model_len=len(prompts[0]) + args.output_len + 16,
              max_num_seqs=len(prompts),
              gpu_memory_utilization=0.85, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    walls = []
    for _ in range(args.runs + 1):      # the first run warms compiles and graphs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    if args.host_split:
        gen = llm.generate
        split = _host_split(lambda: gen(prompts, sp, use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return {"wall_s_unprofiled": sorted(walls[1:]), "host_split": split}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
    path = Path(args.out + (".det" if deterministic else ".fast") + ".json") if args.out else \
        Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    result = analyze(json.loads(path.read_text()), args.min_gap_us, args.depth, args.top)
    result["wall_s_unprofiled"] = sorted(walls[1:])
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=1, help="1: prefill only; more adds decode steps")
    ap.add_argument("--runs", type=int, default=3, help="unprofiled runs per mode before the traced one")
    ap.add_argument("--modes", default="deterministic,fast")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--depth", type=int, default=3, help="innermost Python frames a gap is grouped by")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--host-split", action="store_true",
                    help="no profiler: wall-clock counters on host phases and Ops calls instead")
    ap.add_argument("--out", default=None, help="traces to OUT.det.json / OUT.fast.json, summary OUT.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model_dir = write_shape(args.shape, tmp)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab)
    report = {"shape": args.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for mode in args.modes.split(","):
        r = run_mode(model_dir, prompts, mode == "deterministic", args)
        report[mode] = r
        if args.host_split:
            h = r["host_split"]
            print(f"== {mode}: wall {r['wall_s_unprofiled']} s unprofiled; the counted run "
                  f"{h['wall_ms']:.1f} ms", flush=True)
            for row in h["rows"]:
                print(f"  {row['ms']:9.2f} ms  {row['calls']:6d}x  {row['us_per_call']:8.1f} us  "
                      + row["name"])
            continue
        print(f"== {mode}: wall {r['wall_s_unprofiled']} s unprofiled; traced: span {r['span_ms']:.1f} ms, "
              f"GPU busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms "
              f"(gaps >= {args.min_gap_us:g} us: {r['gaps_ms']:.1f} ms)", flush=True)
        for row in r["top"]:
            print(f"  {row['ms']:8.2f} ms  {row['count']:5d}x  " + "  <  ".join(reversed(row["stack"])))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
