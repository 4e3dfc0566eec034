"""Batch-invariant GEMM tile configs at a model's layer shapes, timed in CUDA graphs, bits checked across M.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python3 benchmarks/gemm_sweep.py --out gemm_05b.json                   # Qwen2.5-0.5B, ~1-2 minutes
    python3 benchmarks/gemm_sweep.py --m 256 --shapes down lm_head         # a subset
    python3 benchmarks/gemm_sweep.py --model llama-3.1-8b --prefill-m 8192  # + prefill-sized M

Per layer shape of `--model` (Qwen2.5-0.5B, hidden 896: qkv 896->1152 with bias, o 896->896, gate_up
896->9728, down 4864->896, lm head 896->151,936; Llama-3.1-8B, hidden 4096) and per candidate MatmulConfig
(pointer loads, and some with TMA tile loads, kernels/matmul_tma.py) it reports:
- time per call in us (a CUDA graph of back-to-back calls, replayed; the weight cycles through enough copies
  that it comes from HBM as in a real decode step, where every layer has its own weights),
- `inv_M`: rows at M = 1, 7, 64 (and a window not starting at row 0) equal, bit for bit, the same rows of the
  M = 256 call (a config alone is batch-invariant by construction; this checks it),
- `eq_planner`: the result equals, bit for bit, today's prefill-bucket config and `matmul_config` (what
  MatmulPlanner requires before it lets a decode bucket use the config),
and the same figures for today's choice (`MatmulPlanner` at that M) and cuBLAS (`F.linear`, fast mode).
The summary adds, per shape, the fastest candidate that passes both checks, and the decode step's GEMM time
(24 layers x 4 GEMMs + the lm head) for today's configs, the best candidates and cuBLAS.

A weight shape whose table takes a split-K (the 0.5B down projection, split 4) has other bits than any
single chain: only candidates of that split (`--split-k`) can match its planner; benchmarks/split_k_sweep.py
is the sweep of split counts and their two forms.

Compiles are the slow part: `--jobs N` warms Triton's on-disk cache in N spawned processes first.
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

DEV = "cuda"
BF16 = torch.bfloat16
MODELS = {   # model -> (decoder layers, {name -> (N, K, bias)})
    "qwen2.5-0.5b": (24, {"qkv": (1152, 896, True), "o": (896, 896, False), "gate_up": (9728, 896, False),
                          "down": (896, 4864, False), "lm_head": (151936, 896, False)}),
    "llama-3.1-8b": (32, {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
                          "gate_up": (28672, 4096, False), "down": (4096, 14336, False),
                          "lm_head": (128256, 4096, False)}),
}
SHAPE_NAMES = ("qkv", "o", "gate_up", "down", "lm_head")
NARROW = ("qkv", "o", "down")
# (block_m, block_n, num_warps, num_stages, persistent[, split_k[, tma[, serial_split]]]); BLOCK_K is 64.
NARROW_CANDIDATES = (
    (64, 32, 4, 4, False), (64, 32, 4, 6, False), (64, 64, 4, 4, False), (64, 64, 4, 6, False),
    (64, 128, 4, 4, False), (64, 128, 4, 5, False), (128, 32, 4, 4, False), (128, 64, 4, 4, False),
    (128, 64, 8, 4, False), (128, 128, 8, 4, False), (32, 64, 4, 4, False), (32, 32, 4, 6, False),
    (64, 64, 4, 4, True), (64, 32, 4, 6, True), (64, 16, 4, 6, False),
)
WIDE_CANDIDATES = (
    (64, 256, 4, 4, False), (128, 256, 8, 4, False), (128, 256, 8, 5, False), (128, 128, 8, 4, False),
    (128, 128, 4, 4, False), (64, 128, 4, 4, False), (256, 128, 8, 3, False), (128, 256, 8, 4, True),
    (128, 128, 8, 4, True),
)
TMA_CANDIDATES = {   # the same tiles with TMA loads: same bits expected (checked), maybe faster
    "narrow": ((64, 32, 4, 6, False, 1, True), (64, 64, 4, 4, False, 1, True), (64, 64, 4, 6, False, 1, True),
               (64, 128, 4, 4, False, 1, True), (64, 128, 4, 5, False, 1, True),
               (128, 128, 8, 4, True, 1, True), (128, 64, 4, 4, False, 1, True),
               # deep pipelines: what the rowwise FP8 decode tiles gained from (kernels/fp8_rowwise.py)
               (64, 32, 4, 8, False, 1, True), (64, 64, 4, 8, False, 1, True),
               (64, 128, 4, 8, False, 1, True), (128, 64, 4, 8, False, 1, True),
               (128, 128, 8, 6, False, 1, True)),
    "wide": ((128, 256, 8, 4, False, 1, True), (64, 256, 4, 4, False, 1, True),
             (128, 128, 8, 4, False, 1, True), (128, 256, 8, 4, True, 1, True),
             (128, 128, 8, 4, True, 1, True),
             # the deepest pipelines that fit an H200's shared memory (~192 KB of tiles)
             (64, 256, 4, 5, False, 1, True), (128, 128, 8, 6, False, 1, True),
             (64, 128, 4, 8, False, 1, True), (128, 128, 8, 6, True, 1, True),
             (64, 256, 4, 5, True, 1, True)),
}
# Prefill-sized M (--prefill-m): today's open-ended bucket and alternatives, each also with TMA loads.
PREFILL_CANDIDATES = tuple(
    spec + (1, tma) for tma in (False, True)
    for spec in ((128, 256, 8, 3, True), (128, 256, 8, 4, True), (128, 256, 8, 3, False),
                 (256, 128, 8, 3, True), (128, 128, 8, 4, True), (128, 128, 4, 4, True),
                 (256, 128, 8, 4, False)))
HBM_BYTES = 160 << 20      # weight copies cycled per timing: more than the H200's 50 MB L2
MAX_COPIES = 96


# Fixed-order split-K (MatmulConfig.split_k): other bits than the single chain, so a shape can only adopt
# it in every bucket, prefill included; these are also timed at PREFILL_M against today's prefill config.
SPLIT_CANDIDATES = {
    "down": ((64, 64, 4, 4, False, 2), (64, 64, 4, 4, False, 4), (64, 64, 4, 4, False, 8),
             (128, 64, 4, 4, False, 4), (128, 128, 8, 4, False, 4), (128, 128, 8, 4, False, 8),
             (64, 128, 4, 4, False, 4), (128, 256, 8, 3, False, 2), (128, 256, 8, 3, False, 4)),
    "o": ((64, 64, 4, 4, False, 2), (128, 128, 8, 4, False, 2), (128, 256, 8, 3, False, 2)),
}
PREFILL_M = 4096


def _split(spec: tuple) -> int:
    return spec[5] if len(spec) > 5 else 1


def _tma(spec: tuple) -> bool:
    return bool(spec[6]) if len(spec) > 6 else False


def _serial(spec: tuple) -> bool:
    return bool(spec[7]) if len(spec) > 7 else False


def _cfg(spec: tuple):
    from deepinfer.kernels.matmul import MatmulConfig

    bm, bn, w, s, p = spec[:5]
    return MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=w, num_stages=s, persistent=p,
                        split_k=_split(spec), tma=_tma(spec), serial_split=_serial(spec))


def _name(spec: tuple) -> str:
    bm, bn, w, s, p = spec[:5]
    tail = (f" split{_split(spec)}" if _split(spec) > 1 else "") + (" serial" if _serial(spec) else "")
    tail += " tma" if _tma(spec) else ""
    return f"{bm}x{bn}x64 w{w} s{s} {'persistent' if p else 'grid'}{tail}"


def _candidates(shape: str, split: bool) -> tuple[tuple, ...]:
    """Decode-sized candidates; the split-K ones only where asked (the 0.5B sweep measured them)."""
    if shape in NARROW:
        splits = SPLIT_CANDIDATES.get(shape, ()) if split else ()
        return NARROW_CANDIDATES + TMA_CANDIDATES["narrow"] + splits
    return WIDE_CANDIDATES + TMA_CANDIDATES["wide"]


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(BF16)


def _operands(dims: tuple[int, int, bool], m: int = 256):
    n, k, bias = dims
    return _randn(m, k, seed=1), _randn(n, k, scale=k ** -0.5, seed=2), (_randn(n, seed=3) if bias else None)


def _warm(job: tuple[tuple, list[tuple]]) -> str:
    """Worker: compile (into Triton's disk cache) every candidate of one shape; returns errors, if any."""
    from deepinfer.kernels.matmul import bi_linear

    dims, specs = job
    x, w, b = _operands(dims)
    errors = []
    for spec in specs:
        try:
            bi_linear(x, w, b, config=_cfg(spec))
        except Exception as e:  # a config may not fit; the main process records it again
            errors.append(f"{dims} {_name(spec)}: {type(e).__name__}")
    torch.cuda.synchronize()
    return "; ".join(errors)


# Today's configs (kernels/matmul.py) that are not candidates: the prefill bucket, matmul_config, M <= 128.
REFERENCE_SPECS = ((128, 256, 8, 3, True), (128, 128, 8, 4, True), (64, 64, 4, 5, False))


def graph_us(make_call, copies: int, replays: int = 10) -> float:
    """us per call: a CUDA graph of `copies` calls (call i uses weight copy i), replayed `replays` times."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def bits_ok(fn, x: torch.Tensor) -> bool:
    """Rows of fn at M = 1, 7, 64 (from row 0 and from a later row) equal the same rows of the full call."""
    full = fn(x)
    for m in (1, 7, 64):
        for start in (0, x.shape[0] - m - 3):
            if not torch.equal(fn(x[start : start + m].clone()), full[start : start + m]):
                return False
    return True


class Sweep:
    """One model's sweep: its shapes, the M values timed, and which candidate families run."""

    def __init__(self, model: str, ms: list[int], prefill_m: int | None, split: bool) -> None:
        self.layers, self.shapes = MODELS[model]
        self.ms, self.prefill_m, self.split = ms, prefill_m, split

    def specs(self, shape: str) -> tuple[tuple, ...]:
        """Every candidate timed for `shape` (decode-sized, then prefill-sized unless the lm head)."""
        extra = PREFILL_CANDIDATES if self.prefill_m and shape != "lm_head" else ()
        return _candidates(shape, self.split) + tuple(s for s in extra if s not in _candidates(shape, False))

    def warm_cache(self, names: list[str], jobs: int) -> float:
        """Compile every (shape, candidate) once into Triton's disk cache, spread over `jobs` processes."""
        t0 = time.perf_counter()
        flat = [(self.shapes[n], spec) for n in names for spec in self.specs(n) + REFERENCE_SPECS]
        work = [(dims, [sp for d, sp in flat[i::jobs] if d == dims]) for i in range(jobs)
                for dims in {d for d, _ in flat}]
        work = [w for w in work if w[1]]
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            for err in pool.map(_warm, work):
                if err:
                    print("warm-up:", err, flush=True)
        return time.perf_counter() - t0

    def shape(self, shape: str) -> dict:
        from deepinfer.kernels.matmul import MatmulPlanner, _bucket_configs, bi_linear, matmul_config

        n, k, _ = self.shapes[shape]
        big = max([256] + ([PREFILL_M] if self.split and shape in SPLIT_CANDIDATES else [])
                  + ([self.prefill_m] if self.prefill_m and shape != "lm_head" else []))
        x_big, w, b = _operands(self.shapes[shape], big)
        x = x_big[:256]
        prefill_cfg = _bucket_configs(n, k, BF16)[-1][1]
        copies = max(1, min(MAX_COPIES, HBM_BYTES // (n * k * 2)))
        weights = [w] + [_randn(n, k, scale=k ** -0.5, seed=10 + i) for i in range(copies - 1)]
        prefill_out = bi_linear(x, w, b, config=prefill_cfg)
        default_out = bi_linear(x, w, b, config=matmul_config(n, k, BF16))
        rows = []

        def record(name: str, fn_for_weight, check, ms, split=1) -> None:
            row: dict = {"shape": shape, "config": name, "split_k": split}
            try:
                for m in ms:
                    xm = x_big[:m].clone()
                    row[f"us_M{m}"] = round(graph_us(lambda i, xm=xm: (lambda: fn_for_weight(xm, weights[i])),
                                                     copies), 2)
                if check:
                    out = fn_for_weight(x, w)
                    row["inv_M"] = bits_ok(lambda t: fn_for_weight(t, w), x)
                    row["eq_planner"] = bool(torch.equal(out, prefill_out) and torch.equal(out, default_out))
            except Exception as e:   # out of shared memory / registers: recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)

        prefill_ms = [self.prefill_m] if self.prefill_m and shape != "lm_head" else []
        planner = MatmulPlanner()
        record("today (MatmulPlanner)", lambda t, wt: bi_linear(t, wt, b, planner=planner), True,
               self.ms + prefill_ms)
        record("cuBLAS F.linear", lambda t, wt: F.linear(t, wt, b), False, self.ms + prefill_ms)
        if self.split and shape in SPLIT_CANDIDATES:
            record("today prefill config", lambda t, wt: bi_linear(t, wt, b, config=prefill_cfg), False,
                   [PREFILL_M])
        decode = _candidates(shape, self.split)
        for spec in self.specs(shape):
            cfg = _cfg(spec)
            fitted = cfg.fit_to_device(x.element_size(), x.device)
            if fitted is not cfg:   # the launch would run fewer stages than the name says: not timed
                rows.append({"shape": shape, "config": _name(spec), "split_k": _split(spec),
                             "error": "needs more shared memory than this device has "
                                      f"({fitted.num_stages} stages fit)"})
                continue
            ms = (self.ms if spec in decode else []) + (prefill_ms if spec in PREFILL_CANDIDATES else [])
            ms += [PREFILL_M] if _split(spec) > 1 else []
            record(_name(spec), lambda t, wt, c=cfg: bi_linear(t, wt, b, config=c), True, ms,
                   split=_split(spec))
        return {"shape": shape, "N": n, "K": k, "weight_copies": copies, "rows": rows,
                "planner_verdicts": planner.verdicts()}

    def summarize(self, results: list[dict], m: int) -> dict:
        key = f"us_M{m}"
        per_shape = {}
        for r in results:
            rows = r["rows"]
            today = next(x for x in rows if x["config"].startswith("today"))
            cublas = next(x for x in rows if x["config"].startswith("cuBLAS"))
            cands = [x for x in rows if "inv_M" in x and not x["config"].startswith("today")]
            ok = [x for x in cands if x["inv_M"] and x["eq_planner"] and key in x]
            best = min(ok, key=lambda x: x[key]) if ok else None
            split_ok = [x for x in cands if x["inv_M"] and x["split_k"] > 1 and key in x]
            best_split = min(split_ok, key=lambda x: x[key]) if split_ok else None
            prefill = next((x for x in rows if x["config"] == "today prefill config"), {})
            pkey = f"us_M{PREFILL_M}"
            per_shape[r["shape"]] = {"today_us": today.get(key), "cublas_us": cublas.get(key),
                                     "best_config": best["config"] if best else None,
                                     "best_us": best[key] if best else None,
                                     "failed_bits": [x["config"] for x in cands if not x["inv_M"]
                                                     or (x["split_k"] == 1 and not x["eq_planner"])]}
            if best_split:
                per_shape[r["shape"]].update(best_split_config=best_split["config"],
                                             best_split_us=best_split[key],
                                             best_split_prefill_us=best_split.get(pkey),
                                             today_prefill_us=prefill.get(pkey))

        def step_ms(field: str, with_head: bool) -> float | None:
            names = SHAPE_NAMES if with_head else SHAPE_NAMES[:4]
            vals = {s: per_shape.get(s, {}).get(field) for s in names}
            if any(v is None for v in vals.values()):
                return None
            layer = sum(vals[s] for s in ("qkv", "o", "gate_up", "down"))
            return round((self.layers * layer + (vals["lm_head"] if with_head else 0)) / 1e3, 3)

        head = m != self.prefill_m   # a prefill step computes the lm head for a few rows only
        return {"M": m, "per_shape": per_shape, "step_ms_today": step_ms("today_us", head),
                "step_ms_best": step_ms("best_us", head), "step_ms_cublas": step_ms("cublas_us", head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=list(MODELS))
    ap.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--prefill-m", type=int, default=None,
                    help="also time prefill-sized tile configs at this M (e.g. 8192, the token budget)")
    ap.add_argument("--split-k", action="store_true", help="also the fixed-order split-K candidates")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPE_NAMES), choices=list(SHAPE_NAMES))
    ap.add_argument("--jobs", type=int, default=min(10, os.cpu_count() or 1),
                    help="processes that pre-compile the candidates (0: compile inline)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    sweep = Sweep(args.model, args.m, args.prefill_m, args.split_k)
    t0 = time.perf_counter()
    warm_s = 0.0
    if args.jobs > 0:
        try:
            warm_s = sweep.warm_cache(args.shapes, args.jobs)
        except Exception as e:   # the sweep compiles inline instead (slower, same results)
            print(f"compile warm-up failed ({type(e).__name__}: {e}); compiling inline", flush=True)
    print(f"compile warm-up: {warm_s:.1f} s", flush=True)
    results = [sweep.shape(s) for s in args.shapes]
    summaries = [sweep.summarize(results, m) for m in args.m + ([args.prefill_m] if args.prefill_m else [])]
    for s in summaries:
        print(json.dumps(s), flush=True)
    out = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "warm_s": warm_s, "total_s": time.perf_counter() - t0, "results": results, "summaries": summaries}
    print(f"total: {out['total_s']:.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
