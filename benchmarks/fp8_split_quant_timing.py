"""Column-split FP8 row quantization (kernels/fp8_split_quant.py) against the one-program kernels.

Run on the GPU machine from the repository root (after `pip install -e .`), under a minute:
    python3 benchmarks/fp8_split_quant_timing.py [--ms 1,64,256,2048,16384] [--out split_quant.json]

µs per call inside CUDA graphs (fp8_gemm_timing.graph_time) at the Llama-3.1-8B widths: the fused
SiLU-and-mul -> e4m3 (I = 14,336, feeding down_proj) and the row quantizer (K = 4,096, o_proj's input).
Arms: `old` = the one-program kernel (`split=0`), `auto` = what the engine runs now (split below
SPLIT_MAX_BYTES, 1,024 columns per program), `sN` = the split kernels forced with N columns per program.
`bits`: every arm's e4m3 codes and scales equal the old kernel's (must be True); `gb_s`: input + output
bytes over the time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import finish_sweep  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

ARMS = {"old": 0, "auto": None, "s512": 512, "s2048": 2048}
# (name, row width, input columns per row): silu_mul reads [gate | up].
OPS = (("silu_mul", 14336, 2 * 14336), ("row_quant", 4096, 4096))


def _fn(op: str, x: torch.Tensor, split: int | None):
    from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant
    from deepinfer.kernels.fp8_row_quant import quantize_rows

    if op == "silu_mul":
        return lambda: silu_and_mul_quant(x, split=split)
    return lambda: quantize_rows(x, split=split)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,64,256,2048,16384")
    ap.add_argument("--budget-s", type=float, default=55.0, help="skip the remaining cases past this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_split_quant_timing.py needs a CUDA GPU")
    start = time.time()
    rows = []
    for op, width, cols in OPS:
        for m in (int(v) for v in args.ms.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(m + width)
            x = (torch.randn(m, cols, device="cuda", generator=gen) * 3).to(torch.bfloat16)
            nbytes = x.numel() * 2 + m * width
            want = None
            for arm, split in ARMS.items():
                rec = {"op": op, "width": width, "m": m, "arm": arm}
                if time.time() - start > args.budget_s:
                    rows.append(dict(rec, error="skipped: time budget"))
                    continue
                fn = _fn(op, x, split)
                q, s = fn()
                if want is None:
                    want = (q.view(torch.uint8).clone(), s.clone())
                sec = graph_time(fn)
                rec.update(us=sec * 1e6, gb_s=nbytes / sec / 1e9,
                           bits=torch.equal(q.view(torch.uint8), want[0]) and torch.equal(s, want[1]))
                rows.append(rec)
                print(json.dumps(rec), flush=True)
            del x
    print("| op (width) | M | " + " | ".join(f"{a} µs" for a in ARMS) + " | bits | best GB/s |")
    print("|---|---|" + "---|" * (len(ARMS) + 2))
    for op, width, _ in OPS:
        for m in dict.fromkeys(r["m"] for r in rows if r["op"] == op):
            cell = {r["arm"]: r for r in rows if (r["op"], r["m"]) == (op, m)}
            us = [f"{cell[a]['us']:.1f}" if "us" in cell.get(a, {}) else "-" for a in ARMS]
            done = [r for r in cell.values() if "us" in r]
            bits = all(r["bits"] for r in done)
            best = max((r["gb_s"] for r in done), default=float("nan"))
            print(f"| {op} ({width}) | {m} | " + " | ".join(us) + f" | {bits} | {best:.0f} |")
    return finish_sweep(rows, args.out, start)


if __name__ == "__main__":
    raise SystemExit(main())
