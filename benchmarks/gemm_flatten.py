"""Prefill-sized GEMMs with the persistent tile loop flattened into the K loop (MatmulConfig.flatten).

Run on the GPU machine from the repository root (after `pip install -e .`), about a minute:
    python3 benchmarks/gemm_flatten.py [--ms 8192 16384] [--runs 5] [--out gemm_flatten.json]

For each layer GEMM of Qwen2.5-0.5B and Llama-3.1-8B as the deterministic engine runs a prefill step (the
planner's open-ended bucket config; gate_up with its SwiGLU epilogue), it times that tile unflattened and
with `flatten=True` (at its stages and one more), in CUDA graphs (µs per call; median and spread of --runs
replays of the graph), checks that each gives the unflattened bits at every M, and sums a prefill step's
GEMM time (layers x shapes). Shapes whose config cannot flatten (a serial split-K: the 0.5B down
projection) are reported as such. The peer is cuBLAS (`F.linear`, what fast mode runs) on the same operands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_sweep import MODELS, graph_us  # noqa: E402

BF16 = torch.bfloat16
SHAPES = ("qkv", "o", "gate_up", "down")


def _arms(cfg) -> dict:
    """name -> config: the tile unflattened, and flattened at its stages and one more (none where the config
    cannot flatten)."""
    arms = {"off": dataclasses.replace(cfg, flatten=False)}
    if cfg.persistent and cfg.tma and cfg.split_k == 1:
        for stages in (cfg.num_stages, cfg.num_stages + 1):
            arms[f"flatten s{stages}"] = dataclasses.replace(cfg, flatten=True, num_stages=stages)
    return arms


def _time(fn, runs: int) -> list[float]:
    return [graph_us(lambda i: fn, copies=4, replays=5) for _ in range(runs)]


def shape_rows(model: str, name: str, ms: list[int], runs: int) -> list[dict]:
    from deepinfer.kernels.matmul import _bucket_configs, bi_linear

    n, k, bias = MODELS[model][1][name]
    swiglu = name == "gate_up"
    cfg = _bucket_configs(n, k, BF16)[-1][1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(BF16)
    b = torch.randn(n, device="cuda", generator=gen).to(BF16) if bias else None
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(BF16)
        ref = bi_linear(x, w, b, config=dataclasses.replace(cfg, flatten=False), swiglu=swiglu)
        flops = 2 * m * n * k
        row = {"model": model, "shape": name, "m": m, "config": str(cfg), "today_flattened": cfg.flatten}
        for arm, c in _arms(cfg).items():
            try:
                same = torch.equal(bi_linear(x, w, b, config=c, swiglu=swiglu), ref) and all(
                    torch.equal(bi_linear(x[:r].clone(), w, b, config=c, swiglu=swiglu), ref[:r])
                    for r in (1, 7, 300))
                us = _time(lambda c=c, x=x: bi_linear(x, w, b, config=c, swiglu=swiglu), runs)
                med = statistics.median(us)
                row[arm] = {"us": med, "min": min(us), "max": max(us), "tflops": flops / med / 1e6,
                            "same_bits": same}
            except Exception as exc:   # a config that does not compile or fit is a result
                row[arm] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        us = _time(lambda x=x: F.linear(x, w, b), runs)
        row["cublas"] = {"us": statistics.median(us), "min": min(us), "max": max(us)}
        if not any(a.startswith("flatten") for a in row):
            row["note"] = "cannot flatten (serial split-K)"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemm_flatten.py needs a CUDA GPU")
    t0 = time.time()
    rows = [r for model in args.models for name in SHAPES
            for r in shape_rows(model, name, args.ms, args.runs)]
    print("| model | shape | M | unflattened µs | flatten (same stages) µs | flatten (+1 stage) µs "
          "| cuBLAS µs | bits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        flats = [v for a, v in r.items() if a.startswith("flatten")]
        cells = [f"{v['us']:.1f} ({v['min']:.1f}-{v['max']:.1f})" if "us" in v else v.get("error", "")
                 for v in [r["off"], *flats]]
        cells += [""] * (3 - len(cells))
        bits = all(v.get("same_bits", False) for v in flats) if flats else "n/a"
        print(f"| {r['model']} | {r['shape']} | {r['m']} | {' | '.join(cells)} | {r['cublas']['us']:.1f} "
              f"| {bits} |")
    layers = {model: MODELS[model][0] for model in args.models}
    for model in args.models:
        for m in args.ms:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            off = sum(r["off"]["us"] for r in sel) * layers[model] / 1e3
            best = sum(min(v["us"] for a, v in r.items() if a.startswith(("off", "flatten")) and "us" in v)
                       for r in sel) * layers[model] / 1e3
            print(f"{model} M={m}: layer GEMMs per prefill step {off:.2f} ms unflattened, {best:.2f} ms with "
                  f"the fastest arm per shape")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "total_s": time.time() - t0}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
