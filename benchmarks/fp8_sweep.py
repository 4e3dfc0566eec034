"""Tile sweep for benchmarks/bench_fp8.py --sweep: every rowwise candidate (kernels/fp8_rowwise.py
ROWWISE_CANDIDATES) and every block-scaled candidate, both K loops (kernels/fp8_matmul.py block_candidates),
on the Llama-3.1-8B layer shapes at each M, GEMM alone on pre-quantized activations, timed in CUDA graphs.

Printed per shape: the best config per M (what a fast-mode M policy would pick) and the best single config
over all M (what the batch-invariant mode, tile a function of (N, K) only, would pick). Checked per config:
the first 64 rows are bitwise the same at every M (the config is batch-invariant on this device); and across
configs of a kernel: which configs give bits identical to each other (configs that agree could share one
batch-invariant M-bucket policy, as kernels/matmul.MatmulPlanner does for bf16).
"""

from __future__ import annotations

import torch

from benchmarks.fp8_gemm_timing import _weights, graph_time


def _name(cfg: dict[str, int]) -> str:
    extra = "".join(f" {k.lower()}{v}" for k, v in cfg.items() if k in ("K_LOOP", "IMPRECISE_ACC") and v)
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}{extra}")


def sweep(layers: dict[str, tuple[int, int]], ms: tuple[int, ...], emit) -> dict:
    from deepinfer.kernels import fp8_matmul as fm
    from deepinfer.kernels import fp8_rowwise as fr

    kernels = {
        "rowwise": (fr.ROWWISE_CANDIDATES,
                    lambda xq, xs, w, cfg: fr.rowwise_matmul(xq, xs, w["row_q"], w["row_s"], None,
                                                             torch.bfloat16, cfg),
                    lambda x: fr.quantize_rows(x)),
        "block": (fm.block_candidates(128),
                  lambda xq, xs, w, cfg: fm.block_matmul(xq, xs, w["block_q"], w["block_s"], None,
                                                         torch.bfloat16, cfg),
                  lambda x: fm.quantize_act(x, 128)),
    }
    report: dict = {}
    for li, (layer, (n, k)) in enumerate(layers.items()):
        wts = _weights(n, k, seed=li)
        x_all = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        for kname, (cands, run, quant) in kernels.items():
            times: dict[str, dict[int, float]] = {}
            heads: dict[str, dict[int, torch.Tensor]] = {}
            failed: dict[str, str] = {}
            for m in ms:
                xq, xs = quant(x_all[:m].contiguous())
                for cfg in cands:
                    name = _name(cfg)
                    if name in failed:
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
            report[f"{kname}/{layer}"] = _summarise(times, heads, failed, ms)
            emit({"part": "sweep-summary", "kernel": kname, "layer": layer, **report[f"{kname}/{layer}"]})
    return report


def _summarise(times: dict[str, dict[int, float]], heads: dict[str, dict[int, torch.Tensor]],
               failed: dict[str, str], ms: tuple[int, ...]) -> dict:
    complete = {c: t for c, t in times.items() if len(t) == len(ms)}
    best_per_m = {m: min(complete, key=lambda c: complete[c][m]) for m in ms} if complete else {}
    best_single = min(complete, key=lambda c: sum(complete[c].values())) if complete else None
    invariant = {c: all(torch.equal(h[ms[0]], h[m]) for m in ms)
                 for c, h in heads.items() if len(h) == len(ms)}
    # Configs whose bits agree with each other (at the largest M): classes of identical output.
    classes: list[list[str]] = []
    for c, h in heads.items():
        if len(h) != len(ms):
            continue
        for cls in classes:
            if torch.equal(heads[cls[0]][ms[-1]], h[ms[-1]]):
                cls.append(c)
                break
        else:
            classes.append([c])
    return {"best_per_m": {m: {"config": c, "us": complete[c][m]} for m, c in best_per_m.items()},
            "best_single": {"config": best_single, "us": complete.get(best_single)},
            "not_invariant_across_m": sorted(c for c, ok in invariant.items() if not ok),
            "bitwise_classes": classes, "failed": failed,
            "us": complete}
