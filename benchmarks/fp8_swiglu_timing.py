"""The SwiGLU in the rowwise FP8 gate_up GEMM's epilogue against the GEMM followed by the fused
SiLU-and-mul quantizer: what an MLP runs between its gate_up input and its down projection's e4m3 rows.

Run on the GPU machine from the repository root (after `pip install -e .`), under a minute:
    python3 benchmarks/fp8_swiglu_timing.py [--ms 1,64,256,2048,16384] [--shape llama-3.1-8b] [--out x.json]

µs per MLP-middle inside CUDA graphs (fp8_gemm_timing.graph_time), the planner's tile for each M (the
deterministic engine's), weights cycled past L2 as a decode step reads them:
- `unfused`: `fp8_rowwise_linear_quantized` over the [gate | up] weight -> [M, 2I] bf16, then
  `silu_and_mul_quant` -> e4m3 [M, I] + row scales (the engine's path until 2026-12-03);
- `epilogue`: `fp8_rowwise_swiglu_quantized` over the gate j / up j weight -> [M, I] bf16, then
  `quantize_rows` (the engine's default; DEEPINFER_DISABLE_SWIGLU_EPILOGUE=1 runs `unfused`);
- `epilogue_split`: the same with `quantize_rows(split=1024)` (the column-split quantizer, which the fused
  SiLU-and-mul quantizer uses at decode sizes; for the row quantizer it is opt-in);
`bits`: every arm's e4m3 codes and scales equal the unfused ones (must be True). Medians of `--repeats`.
The GEMMs alone, to tell the epilogue's cost from the quantizers': `gemm_plain_us` (the [M, 2I] GEMM) and
`gemm_swiglu_us` (the SWIGLU form, [M, I]; `gemm_bits`: equal to silu_and_mul of the plain one), and
`config`, the planner's tile at that M; `--configs`: both GEMM forms again with each named tile
(`gemm_plain[<name>]_us`, `gemm_swiglu[<name>]_us`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import finish_sweep  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

SHAPES = {"llama-3.1-8b": (14336, 4096), "qwen2.5-0.5b": (4864, 896)}   # (I, hidden)
HBM_BYTES = 160 << 20      # weight copies cycled per timing: more than the H200's 50 MB L2


def _arms(m: int, i: int, k: int, configs: dict[str, dict[str, int]] | None = None):
    from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up, quantize_fp8_channel
    from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant
    from deepinfer.kernels.fp8_row_quant import quantize_rows
    from deepinfer.kernels.fp8_rowwise import (
        RowwisePlanner,
        fp8_rowwise_linear_quantized,
        fp8_rowwise_swiglu_quantized,
    )

    gen = torch.Generator(device="cuda").manual_seed(m)
    copies = max(1, min(16, HBM_BYTES // (2 * i * k)))
    plain, inter = [], []
    for _ in range(copies):
        w = (torch.randn(2 * i, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        q, s = quantize_fp8_channel(w)
        plain.append((q, s.contiguous()))
        inter.append(interleave_gate_up(q, s.contiguous()))
    xq, xs = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
    planner = RowwisePlanner()
    step = {"i": 0}

    def unfused():
        q, s = plain[step["i"] % copies]
        step["i"] += 1
        h = fp8_rowwise_linear_quantized(xq, xs, q, s, out_dtype=torch.bfloat16, planner=planner)
        return silu_and_mul_quant(h)

    def epilogue(split: int | None):
        def run():
            q, s = inter[step["i"] % copies]
            step["i"] += 1
            a = fp8_rowwise_swiglu_quantized(xq, xs, q, s, out_dtype=torch.bfloat16, planner=planner)
            return quantize_rows(a, split=split)
        return run

    def gemm(swiglu: bool, config: dict[str, int] | None = None):
        def run():
            q, s = (inter if swiglu else plain)[step["i"] % copies]
            step["i"] += 1
            fn = fp8_rowwise_swiglu_quantized if swiglu else fp8_rowwise_linear_quantized
            return fn(xq, xs, q, s, out_dtype=torch.bfloat16, planner=planner, config=config)
        return run

    config = planner.config(xq, xs, plain[0][0], plain[0][1], None, torch.bfloat16)
    tiles = {f"[{name}]": cfg for name, cfg in (configs or {}).items()}
    return ({"unfused": unfused, "epilogue": epilogue(None), "epilogue_split": epilogue(1024)},
            {"gemm_plain": gemm(False), "gemm_swiglu": gemm(True),
             **{f"gemm_plain{t}": gemm(False, c) for t, c in tiles.items()},
             **{f"gemm_swiglu{t}": gemm(True, c) for t, c in tiles.items()}}, config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,64,256,2048,16384")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=55.0, help="skip the remaining cases past this")
    ap.add_argument("--configs", default="", help="also time both GEMM forms with these rowwise candidates "
                    "(names as benchmarks/fp8_sweep.py prints them, comma-separated)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_swiglu_timing.py needs a CUDA GPU")
    i, k = SHAPES[args.shape]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    configs = None
    if names:
        from benchmarks.fp8_sweep import _name, _rowwise_candidates

        configs = {_name(c): c for c in _rowwise_candidates(("tma",), tuple(names))}
    start = time.time()
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        if time.time() - start > args.budget_s:
            rows.append({"m": m, "error": "skipped: time budget"})
            continue
        from deepinfer.kernels.activation import silu_and_mul

        arms, gemms, config = _arms(m, i, k, configs)
        out = {name: fn() for name, fn in arms.items()}
        qa, sa = out["unfused"]
        rec = {"shape": args.shape, "m": m, "config": config,
               "bits": all(torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
                           for qb, sb in out.values()),
               "gemm_bits": torch.equal(silu_and_mul(gemms["gemm_plain"]()), gemms["gemm_swiglu"]())}
        for name, fn in {**arms, **gemms}.items():
            times = [graph_time(fn) * 1e6 for _ in range(args.repeats)]
            rec[f"{name}_us"] = statistics.median(times)
            rec[f"{name}_us_all"] = [round(t, 2) for t in times]
        rec["gain"] = rec["unfused_us"] / min(rec["epilogue_us"], rec["epilogue_split_us"]) - 1
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    arm_names = ("unfused", "epilogue", "epilogue_split", "gemm_plain", "gemm_swiglu")
    print("| M | " + " | ".join(f"{a} µs" for a in arm_names) + " | best gain | bits | GEMM bits | tile |")
    print("|---" * (len(arm_names) + 5) + "|")
    for r in rows:
        if "gain" in r:
            us = " | ".join(f"{r[f'{a}_us']:.1f}" for a in arm_names)
            c = r["config"]
            tile = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}" + \
                (" tma" if c.get("TMA") else "") + (" persistent" if c.get("PERSISTENT") else "")
            print(f"| {r['m']} | {us} | {100 * r['gain']:+.1f}% | {r['bits']} | {r['gemm_bits']} | {tile} |")
    return finish_sweep(rows, args.out, start)


if __name__ == "__main__":
    raise SystemExit(main())
