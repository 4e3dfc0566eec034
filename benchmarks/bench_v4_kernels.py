"""DeepSeek-V4's attention kernels alone on V4-Flash's shapes: Triton vs the gathered plain-torch paths.

Run on an H200 (about a minute):
    python3 benchmarks/bench_v4_kernels.py --out v4_kernels.json
Per case, milliseconds (median of `--iters` after a warm-up) of: the Triton kernel (kernels/v4_attention.py,
kernels/v4_indexer.py), the gathered einsum path (the shared `Ops` default in fast mode) and, on fewer
tokens, the gathered elementwise path (deterministic mode), scaled to the same token count. Cases: sink
attention over a CSA layer's window 128 + top-512 entries and an HCA layer's window + 64 entries (an 8k
prompt), 64 heads of 512; the Lightning Indexer over 2048 entries (an 8k prompt), 64 heads of 128. Slots
are random over a small cache (as one sequence's tokens share their window and entries): L2-friendly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import JsonOut, spread, sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels case builders
from tests.kernels.test_v4_attention_cpu import make_case, make_indexer_case  # noqa: E402


def _time(fn, call_args: tuple, iters: int, scale: float = 1.0, **kw) -> dict:
    """Milliseconds of fn(*call_args, **kw): median / min / max of `iters` after one warm-up call, times
    `scale` (a path run on fewer tokens, scaled to the full count)."""
    fn(*call_args, **kw)
    sync()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*call_args, **kw)
        sync()
        ms.append(1000 * (time.perf_counter() - t0) * scale)
    out = spread(ms)
    del out["runs"]
    return out


def _attn(c: dict) -> tuple:
    return c["q"], c["sources"], c["sinks"], c["scale"]


def _idx(c: dict) -> tuple:
    return c["q"], c["weights"], c["rows"], c["slots"], c["valid"], c["scale"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="query tokens per call (one 8k prefill chunk)")
    ap.add_argument("--det-tokens", type=int, default=64, help="tokens for the slow deterministic torch path")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu only as a smoke run, with TRITON_INTERPRET=1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deepinfer.engine.layers.ops import Ops
    from deepinfer.kernels.reference.v4_indexer import indexer_scores_ref
    from deepinfer.kernels.v4_attention import v4_sink_attention
    from deepinfer.kernels.v4_indexer import indexer_scores

    fast, det = Ops(), Ops()
    det.deterministic = True  # an instance attribute: the shared default's deterministic branch
    out, report = JsonOut(args.out), {"device": args.device, "tokens": args.tokens}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    n, nd = args.tokens, args.det_tokens
    for name, comp in (("csa_sink_attention", 512), ("hca_sink_attention", 64)):
        case = make_case(n, 64, 512, 128, comp, dtype=torch.bfloat16, seed=comp, device=args.device)
        small = make_case(nd, 64, 512, 128, comp, dtype=torch.bfloat16, seed=comp, device=args.device)
        row = {
            "triton_ms": _time(v4_sink_attention, _attn(case), args.iters),
            "torch_gathered_einsum_ms": _time(fast.v4_sink_attention, _attn(case), args.iters),
            "torch_gathered_elementwise_ms_scaled": _time(det.v4_sink_attention, _attn(small), 2, n / nd),
        }
        out.line({"case": name, **row})
        report[name] = row
    case = make_indexer_case(n, 64, 128, 2048, dtype=torch.bfloat16, seed=1, device=args.device)
    small = make_indexer_case(nd, 64, 128, 2048, dtype=torch.bfloat16, seed=1, device=args.device)
    # The einsum path gathers [T, 2048, 128] keys: run it on an eighth of the tokens, scaled.
    eighth = make_indexer_case(n // 8, 64, 128, 2048, dtype=torch.bfloat16, seed=1, device=args.device)
    row = {
        "triton_ms": _time(indexer_scores, _idx(case), args.iters),
        "torch_gathered_einsum_ms_scaled": _time(indexer_scores_ref, _idx(eighth), args.iters, 8.0),
        "torch_gathered_elementwise_ms_scaled": _time(indexer_scores_ref, _idx(small), 2, n / nd,
                                                      invariant=True),
    }
    out.line({"case": "indexer_scores", **row})
    report["indexer_scores"] = row
    out.summary(report)


if __name__ == "__main__":
    main()
