"""Fixed-order split-K for the batch-invariant GEMM at a model's long-K layer shapes: is there a split count
whose decode form (parallel: a program per tile and K range, fp32 partials, an ordered sum) beats today's
decode buckets by more than its prefill form (serial: the ranges one after another in a tile's program, the
sum in registers) loses against today's prefill tile? Both forms give the same bits, so a weight shape may
take a split count in every bucket (kernels/matmul_split.py).

Run on the GPU machine from the repository root:
    python3 benchmarks/split_k_sweep.py --model qwen2.5-0.5b --shapes down --out split05.json
    python3 benchmarks/split_k_sweep.py --model llama-3.1-8b --shapes down o --prefill-m 8192

Per shape and split count: every decode candidate (TMA tiles) at `--m`, every serial candidate at
`--prefill-m`, timed in CUDA graphs with the weight cycling through copies larger than L2
(gemm_sweep.graph_us), beside today's planner and cuBLAS at the same M. Bits: each candidate's rows at
M = 1, 7, 64 equal its M = 256 rows (gemm_sweep.bits_ok), and its M = 256 result equals the split count's
reference (the parallel form with pointer loads); a serial candidate's first 256 rows at the prefill M too.
The summary gives, per split count, the best passing decode candidate per M and serial candidate, and the
estimated change per decode step (at the largest --m, times the model's layers) and per prefill step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F
from gemm_sweep import HBM_BYTES, MAX_COPIES, MODELS, _cfg, _name, _operands, _randn, _warm, bits_ok, graph_us

DECODE_TILES = ((64, 32, 4, 4), (64, 32, 4, 6), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 4),
                (128, 64, 4, 4), (128, 128, 8, 4))
SERIAL_TILES = ((128, 128, 8, 4, True), (128, 128, 8, 3, True), (128, 256, 8, 3, True), (128, 64, 4, 4, True),
                (128, 128, 8, 4, False))


def candidates(split: int) -> tuple[list[tuple], list[tuple]]:
    """(decode specs, serial specs) of one split count, in gemm_sweep's spec form."""
    decode = [(bm, bn, w, s, False, split, True) for bm, bn, w, s in DECODE_TILES]
    serial = [(bm, bn, w, s, p, split, True, True) for bm, bn, w, s, p in SERIAL_TILES]
    return decode, serial


def sweep_shape(model: str, shape: str, splits: list[int], ms: list[int], prefill_m: int) -> dict:
    from deepinfer.kernels.matmul import MatmulConfig, MatmulPlanner, bi_linear

    dims = MODELS[model][1][shape]
    n, k, _ = dims
    x_big, w, b = _operands(dims, max(prefill_m, 256))
    x = x_big[:256].clone()
    copies = max(1, min(MAX_COPIES, HBM_BYTES // (n * k * 2)))
    weights = [w] + [_randn(n, k, scale=k ** -0.5, seed=10 + i) for i in range(copies - 1)]
    rows: list[dict] = []

    def record(name: str, fn, at: list[int], split: int, ref: torch.Tensor | None, big: bool) -> None:
        row: dict = {"shape": shape, "config": name, "split_k": split}
        try:
            for m in at:
                xm = x_big[:m].clone()
                row[f"us_M{m}"] = round(graph_us(lambda i, xm=xm: (lambda: fn(xm, weights[i])), copies), 2)
            if ref is not None:
                row["inv_M"] = bits_ok(lambda t: fn(t, w), x)
                row["eq_ref"] = bool(torch.equal(fn(x, w), ref))
                if big:
                    row["eq_ref_in_prefill"] = bool(torch.equal(fn(x_big, w)[:256], ref))
        except Exception as e:   # out of shared memory / registers: recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    planner = MatmulPlanner()
    record("today (MatmulPlanner)", lambda t, wt: bi_linear(t, wt, b, planner=planner), ms + [prefill_m], 1,
           None, False)
    record("cuBLAS F.linear", lambda t, wt: F.linear(t, wt, b), ms + [prefill_m], 1, None, False)
    for split in splits:
        ref_cfg = MatmulConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=split)
        ref = bi_linear(x, w, b, config=ref_cfg)
        decode, serial = candidates(split)
        for spec in decode + serial:
            cfg = _cfg(spec)
            record(_name(spec), lambda t, wt, c=cfg: bi_linear(t, wt, b, config=c),
                   ms if spec in decode else [prefill_m], split, ref, spec in serial)
    return {"shape": shape, "N": n, "K": k, "weight_copies": copies, "rows": rows}


def summarize(result: dict, layers: int, ms: list[int], prefill_m: int) -> dict:
    rows = result["rows"]
    today, cublas = rows[0], rows[1]
    pkey = f"us_M{prefill_m}"
    out: dict = {"shape": result["shape"], "today": {k: v for k, v in today.items() if k.startswith("us_")},
                 "cublas": {k: v for k, v in cublas.items() if k.startswith("us_")}, "splits": {}}
    for split in sorted({r["split_k"] for r in rows[2:]}):
        ok = [r for r in rows[2:] if r["split_k"] == split and r.get("inv_M") and r.get("eq_ref")
              and r.get("eq_ref_in_prefill", True)]
        best = {}
        for m in ms:
            cands = [r for r in ok if f"us_M{m}" in r]
            if cands:
                top = min(cands, key=lambda r: r[f"us_M{m}"])
                best[m] = (top["config"], top[f"us_M{m}"])
        serial = [r for r in ok if pkey in r]
        top_serial = min(serial, key=lambda r: r[pkey]) if serial else None
        entry: dict = {"decode_best": best,
                       "serial_best": (top_serial["config"], top_serial[pkey]) if top_serial else None,
                       "failed_bits": [r["config"] for r in rows[2:]
                                       if r["split_k"] == split and "error" not in r and r not in ok]}
        m = max(ms)
        if m in best and top_serial and f"us_M{m}" in today:
            entry["decode_step_ms_change"] = round(layers * (best[m][1] - today[f"us_M{m}"]) / 1e3, 4)
            entry["prefill_step_ms_change"] = round(layers * (top_serial[pkey] - today[pkey]) / 1e3, 4)
        out["splits"][split] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=list(MODELS))
    ap.add_argument("--shapes", nargs="+", default=["down"])
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--prefill-m", type=int, default=16384)
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                    help="processes that pre-compile the candidates into Triton's cache (0: inline)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layers, shapes = MODELS[args.model]
    t0 = time.perf_counter()
    if args.jobs > 0:
        specs = [s for sp in args.splits for part in candidates(sp) for s in part]
        work = [(shapes[name], specs[i::args.jobs]) for name in args.shapes for i in range(args.jobs)]
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
            for err in pool.map(_warm, [w for w in work if w[1]]):
                if err:
                    print("warm-up:", err, flush=True)
    print(f"compile warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
    results = [sweep_shape(args.model, s, args.splits, args.m, args.prefill_m) for s in args.shapes]
    summaries = [summarize(r, layers, args.m, args.prefill_m) for r in results]
    for s in summaries:
        print(json.dumps(s), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "results": results,
                       "summaries": summaries, "total_s": time.perf_counter() - t0}, f, indent=2)


if __name__ == "__main__":
    main()
