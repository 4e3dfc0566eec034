"""Block-scaled FP8 GEMM sweep (benchmarks/bench_fp8.py --sweep --sweep-kernels block): every candidate of
kernels/fp8_block_plan.BLOCK_SWEEP_CANDIDATES on the Llama-3.1-8B layer shapes at M = 1 ... 16,384, the GEMM
alone on pre-quantized activations (one weight scale per 128 x 128 block, the engine's case), timed in CUDA
graphs (benchmarks/fp8_gemm_timing.graph_time), beside the same shapes' peers: the rowwise kernel with its
M-bucket config (`rowwise_buckets`, per-channel weights, rows quantized per row), torch._scaled_mm rowwise
(the FP8 ceiling measured so far), torch._scaled_mm block-wise 1x128 x 128x128 (cuBLAS, where this torch
has it), cuBLAS bf16, and `quantize_act` alone (what the fused producers save).

Bits: at every M each candidate's whole output is compared with the reference config's
(fp8_block_plan.REFERENCE, the single config deterministic mode runs today), and its first rows with the
same rows at the largest M (batch invariance on this device). Only candidates equal to the reference at
every measured M of every layer of a class may enter that class's bucket table.

Printed at the end: per layer and M the reference, the table's pick, the fastest candidate of any bits and
the peers (µs per call), then `BLOCK_BUCKET_TABLE = {...}`, ready to paste into kernels/fp8_block_plan.py
(per shape class, per M the candidate with the least summed time over the class's layers, adjacent equal
picks merged). `budget_s` bounds the wall time: (layer, M) pairs not started in time are listed as skipped
and left out of the table.
"""

from __future__ import annotations

import time

import torch

from benchmarks.fp8_gemm_timing import _weights, gemm_arms, graph_time

BLOCK_MS = (1, 16, 64, 128, 256, 2048, 16384)
# Rows compared across M for batch invariance (all of them below this).
_HEAD_ROWS = 64
# What the sweep times beside the candidates (module docstring), in the printed table's column order.
_PEERS = ("rowwise_bucket", "scaled_mm_rowwise", "scaled_mm_block", "cublas_bf16", "quantize_act")


def _calls(m: int) -> int:
    """Calls per CUDA graph: fewer for prefill-sized M (each is milliseconds already)."""
    return 20 if m <= 2048 else 5


def _peer_fns(x: torch.Tensor, wts: dict[str, torch.Tensor]) -> dict[str, object]:
    """The peers (`_PEERS`): fp8_gemm_timing's arms where it has them, and torch's block-wise _scaled_mm."""
    from deepinfer.kernels import fp8_matmul as fm

    arms = gemm_arms(x, wts)
    m, k = x.shape
    xq_b, xs_b = fm.quantize_act(x, 128)
    # cuBLASLt's block-wise FP8 wants M a multiple of 4 and the activation scales M-major; the weight scales
    # are the checkpoint's [N/128, K/128] block scales, K-major (torch's test_scaled_mm_block_wise_numerics).
    pad = -m % 4
    xq_p = torch.cat([xq_b, xq_b.new_zeros(pad, k)]) if pad else xq_b
    xs_p = torch.cat([xs_b, xs_b.new_ones(pad, xs_b.shape[1])]) if pad else xs_b
    xs_mmajor = xs_p.t().contiguous().t()
    return {
        "rowwise_bucket": arms["rowwise_bucket_alone"],
        "scaled_mm_rowwise": arms["scaled_mm_rowwise_alone"],
        "scaled_mm_block": lambda: torch._scaled_mm(xq_p, wts["block_q"].T, scale_a=xs_mmajor,
                                                    scale_b=wts["block_inv"].t(), out_dtype=torch.bfloat16),
        "cublas_bf16": arms["cublas_bf16"],
        "quantize_act": arms["quant_block"],
    }


def _time(fn, m: int) -> tuple[float | None, str | None]:
    try:
        return graph_time(fn, calls=_calls(m)) * 1e6, None
    except Exception as e:  # noqa: BLE001 - e.g. a tile needing more shared memory, a torch without the op
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def block_sweep(layers: dict[str, tuple[int, int]], ms: tuple[int, ...], emit,
                budget_s: float | None = None, candidates: tuple[str, ...] | None = None) -> dict:
    """Time and bit-check every candidate (and the peers) on every (layer, M); see the module docstring."""
    from deepinfer.kernels import fp8_block_plan as bp

    names = tuple(dict.fromkeys((bp.REFERENCE, *(candidates or bp.BLOCK_SWEEP_CANDIDATES))))
    cfgs = {name: bp.parse_config(name) for name in names}
    ms = tuple(sorted(ms))
    t0 = time.perf_counter()
    report: dict = {"ms": list(ms), "reference": bp.REFERENCE, "layers": {}, "skipped": []}
    wts = {layer: _weights(n, k, seed=li) for li, (layer, (n, k)) in enumerate(layers.items())}
    xs_all = {k: torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16) for _, k in layers.values()}
    heads: dict[str, dict[str, dict[int, torch.Tensor]]] = {layer: {} for layer in layers}
    for layer, (n, k) in layers.items():
        report["layers"][layer] = {"n": n, "k": k, "class": bp.shape_class(n, k), "us": {}, "same_as_ref": {},
                                   "invariant": {}, "peers": {}, "failed": {}}
    # M outer, layers inner: a budget cut drops the largest M of every layer, never a whole layer.
    for m in ms:
        for layer, (_, k) in layers.items():
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                report["skipped"].append(f"{layer}/M={m}")
                continue
            _layer_at_m(report["layers"][layer], heads[layer], wts[layer], xs_all[k][:m], names, cfgs,
                        layer, emit)
        torch.cuda.empty_cache()
    for layer, per_name in heads.items():
        for name, h in per_name.items():
            top = h[max(h)]
            # Rows 0 .. min(M, 64) of every M against the same rows at the largest M measured.
            same = all(torch.equal(v, top[:v.shape[0]]) for v in h.values())
            report["layers"][layer]["invariant"][name] = same
    report["table"] = bucket_table(report)
    report["wall_s"] = time.perf_counter() - t0
    return report


def _layer_at_m(rec: dict, heads: dict[str, dict[int, torch.Tensor]], w: dict[str, torch.Tensor],
                x: torch.Tensor, names: tuple[str, ...], cfgs: dict[str, dict[str, int]], layer: str,
                emit) -> None:
    """One (layer, M): every candidate timed and compared with the reference's output, then the peers."""
    from deepinfer.kernels import fp8_block_plan as bp
    from deepinfer.kernels import fp8_matmul as fm

    m, n, k = x.shape[0], w["w"].shape[0], x.shape[1]
    xq, xs = fm.quantize_act(x, 128)
    ref = fm.block_matmul(xq, xs, w["block_q"], w["block_s"], None, torch.bfloat16, cfgs[bp.REFERENCE])
    for name in names:
        if name in rec["failed"]:
            continue

        def fn(cfg: dict[str, int] = cfgs[name]) -> torch.Tensor:
            return fm.block_matmul(xq, xs, w["block_q"], w["block_s"], None, torch.bfloat16, cfg,
                                   scale_block_n=128)
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the candidate dropped for this layer
            rec["failed"][name] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        us, err = _time(fn, m)
        if us is None:
            rec["failed"][name] = err
            continue
        same = bool(torch.equal(out, ref))
        rec["us"].setdefault(name, {})[m] = us
        rec["same_as_ref"].setdefault(name, {})[m] = same
        heads.setdefault(name, {})[m] = out[:_HEAD_ROWS].clone()
        emit({"part": "block-sweep", "layer": layer, "m": m, "config": name, "us": us,
              "tflops": 2.0 * m * n * k / (us * 1e-6) / 1e12, "same_as_ref": same})
    for peer, pfn in _peer_fns(x, w).items():
        us, err = _time(pfn, m)
        rec["peers"].setdefault(peer, {})[m] = us if us is not None else err
        emit({"part": "block-sweep-peer", "layer": layer, "m": m, "peer": peer, "us": us, "error": err})


def _eligible(report: dict, cls: str) -> set[str]:
    """Candidates bitwise equal to the reference at every measured M of every layer of `cls`, and
    invariant across M there."""
    recs = [r for r in report["layers"].values() if r["class"] == cls]
    ok = None
    for r in recs:
        good = {name for name, same in r["same_as_ref"].items()
                if all(same.values()) and r["invariant"].get(name, False)}
        ok = good if ok is None else ok & good
    return ok or set()


def bucket_table(report: dict) -> dict[str, list[tuple[int | None, str]]]:
    """Per shape class: (max_m, config) buckets from the fastest eligible candidate per M (summed over the
    class's layers), adjacent equal picks merged, the last bucket open-ended."""
    table: dict[str, list[tuple[int | None, str]]] = {}
    for cls in dict.fromkeys(r["class"] for r in report["layers"].values()):
        recs = [r for r in report["layers"].values() if r["class"] == cls]
        ok = _eligible(report, cls)
        picks: list[tuple[int, str]] = []
        for m in report["ms"]:
            # The class's layers measured at this M (a budget cut may have skipped some).
            at_m = [r for r in recs if m in r["us"].get(report["reference"], {})]
            totals = {name: sum(r["us"][name][m] for r in at_m) for name in ok
                      if at_m and all(m in r["us"].get(name, {}) for r in at_m)}
            if totals:
                picks.append((m, min(totals, key=totals.get)))
        buckets: list[tuple[int | None, str]] = []
        for m, name in picks:
            if buckets and buckets[-1][1] == name:
                buckets[-1] = (m, name)
            else:
                buckets.append((m, name))
        if buckets:
            buckets[-1] = (None, buckets[-1][1])
            table[cls] = buckets
    return table


def block_sweep_text(report: dict) -> str:
    """Per layer and M: reference, the table's pick, the fastest of any bits, the peers (µs); then the
    table as Python to paste."""
    from deepinfer.kernels.bucket_planner import bucket_for

    lines = [f"block sweep, reference {report['reference']}, wall {report.get('wall_s', 0):.0f} s"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else ("n/a" if v is None else "err")  # noqa: E731
    for layer, r in report["layers"].items():
        lines.append(f"== {layer} {r['n']}x{r['k']} ({r['class']}); failed: {r['failed'] or 'none'}; "
                     f"not equal to the reference somewhere: "
                     f"{sorted(n for n, s in r['same_as_ref'].items() if not all(s.values())) or 'none'}; "
                     f"not invariant: {sorted(n for n, v in r['invariant'].items() if not v) or 'none'}")
        lines.append("   M | reference | table pick | best any (config) | " + " | ".join(_PEERS))
        buckets = report["table"].get(r["class"])
        for m in report["ms"]:
            if m not in r["us"].get(report["reference"], {}):
                continue
            pick = bucket_for(buckets, m) if buckets else None
            best = min((n for n in r["us"] if m in r["us"][n]), key=lambda n: r["us"][n][m])
            peers = " | ".join(fmt(r["peers"].get(p, {}).get(m)) for p in _PEERS)
            lines.append(f"   {m} | {r['us'][report['reference']][m]:.1f} | "
                         f"{fmt(r['us'].get(pick, {}).get(m)) if pick else 'n/a'} ({pick}) | "
                         f"{r['us'][best][m]:.1f} ({best}) | {peers}")
        errors = {p: v for p, per_m in r["peers"].items() for v in per_m.values() if isinstance(v, str)}
        if errors:
            lines.append(f"   peer errors: {errors}")
    lines.append("BLOCK_BUCKET_TABLE: dict[str, tuple[tuple[int | None, str], ...]] = {")
    for cls, buckets in report["table"].items():
        inner = ", ".join(f'({b!r}, "{name}")' for b, name in buckets)
        lines.append(f'    "{cls}": ({inner},),')
    lines.append("}")
    if report["skipped"]:
        lines.append(f"skipped for the time budget: {report['skipped']}")
    return "\n".join(lines)
