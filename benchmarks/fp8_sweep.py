"""Tile sweep for benchmarks/bench_fp8.py --sweep: the rowwise candidates (kernels/fp8_rowwise.py
ROWWISE_CANDIDATES with pointer loads, ROWWISE_TMA_CANDIDATES with TMA tile loads) on the Llama-3.1-8B layer
shapes at each M (decode-sized to prefill-sized, 8192 by default), GEMM alone on pre-quantized activations,
timed in CUDA graphs. The block-scaled kernel has its own sweep (benchmarks/fp8_block_sweep.py: candidates
checked bitwise against the reference config, its bucket table printed ready to paste).

Printed per shape: the best config per M (what a fast-mode M policy would pick) and the best single config
over all M (what the batch-invariant mode without a planner would pick). Checked per config: the first 64
rows are bitwise the same at every M (the config is batch-invariant on this device); across configs of a
kernel: which configs give bits identical to each other (configs that agree can share one batch-invariant
M-bucket table, as kernels/fp8_rowwise.RowwisePlanner does after proving it on the device), the best
config per M within each such class (a bucket table to pick), and for the rowwise kernel how the current
`rowwise_buckets` table does (its configs' class, its time per M against the best of that class).
`budget_s` bounds the sweep's wall time: once spent, the remaining (layer, kernel) pairs are skipped and
listed, so a GPU run of fixed length always ends with the figures measured so far.
"""

from __future__ import annotations

import itertools
import time

import torch

from benchmarks.fp8_gemm_timing import _weights, graph_time

KERNELS = ("rowwise",)
# Weight bytes a graph of calls cycles through (copies of the layer's weight): three times the H200's
# 50 MB L2, so the small layers (o: 16 MB in FP8) are timed reading HBM as in a decode step.
COLD_BYTES = 150 * 2**20
LOADS = ("pointer", "tma")
# `quick=True`: the rowwise tiles a bucket table would choose between (TMA, and today's pointer tile), so a
# fixed-length GPU run can sweep M = 64 .. 8192 on every layer in well under a minute.
QUICK_ROWWISE = ("64x64x128 w4 s4 tma", "64x128x128 w4 s4 tma", "64x128x128 w4 s4", "128x128x128 w8 s4 tma",
                 "128x256x128 w8 s3 tma", "128x256x128 w8 s3 tma pers", "128x256x128 w8 s4 tma pers")


def _name(cfg: dict[str, int]) -> str:
    extra = "".join(f" {k.lower()}{v}" for k, v in cfg.items() if k in ("K_LOOP", "IMPRECISE_ACC") and v)
    loads = ((" tma" + (" pers" if cfg.get("PERSISTENT") else "") + (" flat" if cfg.get("FLATTEN") else ""))
             if cfg.get("TMA") else "")
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}{extra}{loads}")


def _rowwise_candidates(loads: tuple[str, ...], quick: bool | tuple[str, ...],
                        promote: int = 0) -> tuple[dict[str, int], ...]:
    """The candidates of `loads`; `quick`: True for QUICK_ROWWISE, or the names to keep; `promote` > 0 adds
    each candidate again with IMPRECISE_ACC = promote (its FP8 partial sums promoted to fp32 every `promote`
    K elements: other bits than Triton's sm_90 default, kernels/fp8_rowwise.py), named "...
    imprecise_acc<N>"."""
    from deepinfer.kernels import fp8_rowwise as fr

    cands = ((fr.ROWWISE_CANDIDATES if "pointer" in loads else ())
             + (fr.ROWWISE_TMA_CANDIDATES if "tma" in loads else ()))
    if promote:
        known = {_name(c) for c in cands}
        promoted = ({**c, "IMPRECISE_ACC": promote} for c in cands if not c.get("IMPRECISE_ACC"))
        cands += tuple(c for c in promoted if _name(c) not in known)
    if not quick:
        return cands
    names = QUICK_ROWWISE if quick is True else quick
    unknown = sorted(set(names) - {_name(c) for c in cands})
    if unknown:
        raise SystemExit(f"--sweep-names: no candidate is named {unknown}; "
                         f"names: {[_name(c) for c in cands]}")
    return tuple(c for c in cands if _name(c) in names)


def sweep(layers: dict[str, tuple[int, int]], ms: tuple[int, ...], emit,
          kernels: tuple[str, ...] = KERNELS, loads: tuple[str, ...] = LOADS,
          budget_s: float | None = None, quick: bool | tuple[str, ...] = False, promote: int = 0) -> dict:
    """Time every candidate of `kernels` on every (layer, M); `loads` picks the rowwise loaders swept,
    `quick` the short rowwise list (True: QUICK_ROWWISE; a tuple: the candidates of those names), `promote`
    adds the promoted form of each (`_rowwise_candidates`)."""
    from deepinfer.kernels import fp8_rowwise as fr

    def rowwise(xq: torch.Tensor, xs: torch.Tensor, w: dict, cfg: dict[str, int]) -> torch.Tensor:
        # Each call takes the next weight copy, so a graph of calls reads its weights from HBM (as a decode
        # step does, every layer with its own) even where one copy would fit in L2.
        q, s = next(w["row_copies"])
        return fr.rowwise_matmul(xq, xs, q, s, None, torch.bfloat16, cfg)

    table = {"rowwise": (_rowwise_candidates(loads, quick, promote), rowwise, lambda x: fr.quantize_rows(x))}
    ms = tuple(sorted(ms))
    report: dict = {"skipped_for_budget": []}
    t0 = time.perf_counter()
    for li, (layer, (n, k)) in enumerate(layers.items()):
        wts = _weights(n, k, seed=li)
        copies = max(1, -(-COLD_BYTES // wts["row_q"].numel()))
        wts["row_copies"] = itertools.cycle([(wts["row_q"], wts["row_s"])] + [
            (wts["row_q"].clone(), wts["row_s"].clone()) for _ in range(copies - 1)])
        x_all = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        for kname in kernels:
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                report["skipped_for_budget"].append(f"{kname}/{layer}")
                continue
            cands, run, quant = table[kname]
            times: dict[str, dict[int, float]] = {}
            heads: dict[str, dict[int, torch.Tensor]] = {}
            failed: dict[str, str] = {}
            for m in ms:
                xq, xs = quant(x_all[:m].contiguous())
                for cfg in cands:
                    name = _name(cfg)
                    if name in failed:
                        continue
                    fitted = fr.fit_to_device(cfg, xq.device)
                    if fitted is not cfg:   # would launch with fewer stages than its name says
                        failed[name] = ("needs more shared memory than this device has "
                                        f"({fitted['num_stages']} stages fit)")
                        continue
                    try:
                        out = run(xq, xs, wts, cfg)
                        sec = graph_time(lambda r=run, a=(xq, xs, wts), cfg=cfg: r(*a, cfg))
                    except Exception as e:  # noqa: BLE001 - e.g. a tile that needs more shared memory
                        failed[name] = f"{type(e).__name__}: {str(e)[:120]}"
                        continue
                    times.setdefault(name, {})[m] = sec * 1e6
                    heads.setdefault(name, {})[m] = out[:min(ms)].clone()
                    emit({"part": "sweep", "kernel": kname, "layer": layer, "m": m, "config": name,
                          "us": sec * 1e6, "tflops": 2.0 * m * n * k / sec / 1e12})
            summary = _summarise(times, heads, failed, ms)
            if kname == "rowwise":
                summary["bucket_table"] = _bucket_table(fr.rowwise_buckets(n, k), summary, times, ms)
            report[f"{kname}/{layer}"] = summary
            emit({"part": "sweep-summary", "kernel": kname, "layer": layer,
                  **{key: v for key, v in summary.items() if key != "us"}})
        del wts, x_all
        torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - t0
    return report


def _summarise(times: dict[str, dict[int, float]], heads: dict[str, dict[int, torch.Tensor]],
               failed: dict[str, str], ms: tuple[int, ...]) -> dict:
    complete = {c: t for c, t in times.items() if len(t) == len(ms)}
    best_per_m = {m: min(complete, key=lambda c: complete[c][m]) for m in ms} if complete else {}
    best_single = min(complete, key=lambda c: sum(complete[c].values())) if complete else None
    invariant = {c: all(torch.equal(h[ms[0]], h[m]) for m in ms)
                 for c, h in heads.items() if len(h) == len(ms)}
    # Configs whose bits agree with each other at every M: classes of identical output.
    classes: list[list[str]] = []
    for c, h in heads.items():
        if len(h) != len(ms):
            continue
        for cls in classes:
            if all(torch.equal(heads[cls[0]][m], h[m]) for m in ms):
                cls.append(c)
                break
        else:
            classes.append([c])
    # Per class, the fastest member at each M: a bucket table whose configs are known to agree here.
    class_best = [{m: {"config": min((c for c in cls if c in complete), key=lambda c: complete[c][m]),
                       "us": min(complete[c][m] for c in cls if c in complete)} for m in ms}
                  if any(c in complete for c in cls) else None for cls in classes]
    return {"best_per_m": {m: {"config": c, "us": complete[c][m]} for m, c in best_per_m.items()},
            "best_single": {"config": best_single, "us": complete.get(best_single)},
            "not_invariant_across_m": sorted(c for c, ok in invariant.items() if not ok),
            "bitwise_classes": classes, "best_per_m_by_class": class_best, "failed": failed,
            "us": complete}


def _bucket_table(buckets, summary: dict, times: dict[str, dict[int, float]], ms: tuple[int, ...]) -> dict:
    """How `rowwise_buckets` does at each swept M: its config and time, and whether all its configs fell in
    one bitwise class (what the planner's proof checks in the engine)."""
    from deepinfer.kernels.bucket_planner import bucket_for

    names = [_name(cfg) for _, cfg in buckets]
    cls = [c for c in summary["bitwise_classes"] if names[0] in c]
    agree = bool(cls) and all(name in cls[0] for name in names)
    per_m = {}
    for m in ms:
        name = _name(bucket_for(buckets, m))
        best = summary["best_per_m"].get(m, {})
        per_m[m] = {"config": name, "us": times.get(name, {}).get(m), "best_any": best.get("us"),
                    "best_any_config": best.get("config")}
    return {"configs": names, "agree_bitwise": agree, "per_m": per_m}


def sweep_table(report: dict) -> str:
    """A short text summary: per (kernel, layer), the bucket table's µs per M against the best, and the
    fastest config per M within the bucket table's bitwise class."""
    lines = []
    for key, s in report.items():
        if not isinstance(s, dict) or "best_per_m" not in s:
            continue
        lines.append(f"== {key}: best single {s['best_single']['config']}; "
                     f"not invariant across M: {s['not_invariant_across_m'] or 'none'}; "
                     f"{len(s['bitwise_classes'])} bitwise classes; failed {len(s['failed'])}")
        for m, b in s["best_per_m"].items():
            lines.append(f"   M={m}: best {b['config']} {b['us']:.1f} us")
        table = s.get("bucket_table")
        if table:
            lines.append(f"   buckets {table['configs']} agree bitwise: {table['agree_bitwise']}")
            for m, row in table["per_m"].items():
                us = "n/a" if row["us"] is None else f"{row['us']:.1f}"
                lines.append(f"   M={m}: bucket {row['config']} {us} us")
            cls = next((i for i, c in enumerate(s["bitwise_classes"]) if table["configs"][0] in c), None)
            if cls is not None and s["best_per_m_by_class"][cls] is not None:
                for m, b in s["best_per_m_by_class"][cls].items():
                    lines.append(f"   M={m}: best of the bucket class {b['config']} {b['us']:.1f} us")
    if report.get("skipped_for_budget"):
        lines.append(f"skipped for the time budget: {report['skipped_for_budget']}")
    return "\n".join(lines)
