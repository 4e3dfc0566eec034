"""DeepSeek-V4's routed experts alone on the benchmark's V4 shape: fused Triton MoE vs the per-expert loop.

Run on an H200 (about a minute):
    python3 benchmarks/bench_v4_moe.py --out v4_moe.json
32 experts, hidden 4096, intermediate 2048, top-6, bf16, clipped SwiGLU (swiglu_limit 10, V4's default).
Per token count, milliseconds (median of `--iters` after a warm-up) of the whole routed-expert op (routing
given): `per_expert_*`, the shared `Ops.routed_experts` (experts_ref + combine_experts: one GEMM pair per
expert through the backend's linear, the path V4 took on CUDA before the fused kernel) with the invariant
Triton GEMM (det) and cuBLAS (fast); `fused_*`, kernels/fused_moe.py's clipped variant, invariant and fast
tiles; `fused_det_unclipped`, the plain SwiGLU kernel (what the clamp costs).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import JsonOut, spread, sync

EXPERTS, TOP_K, HIDDEN, INTER, LIMIT = 32, 6, 4096, 2048, 10.0


def _time(fn, iters: int) -> dict:
    """Milliseconds of fn(): median / min / max of `iters` after one warm-up call (host syncs included:
    the per-expert loop syncs for its expert list anyway)."""
    fn()
    sync()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ms.append(1000 * (time.perf_counter() - t0))
    out = spread(ms)
    del out["runs"]
    return out


def _arms(args: tuple, det, fast) -> dict:
    """The compared calls on one (x, ids, weights, gate_up, down)."""
    from deepinfer.engine.layers.ops import Ops
    from deepinfer.kernels.fused_moe import fused_moe

    return {
        "per_expert_det": lambda: Ops.routed_experts(det, *args, swiglu_limit=LIMIT),
        "per_expert_fast": lambda: Ops.routed_experts(fast, *args, swiglu_limit=LIMIT),
        "fused_det": lambda: fused_moe(*args, invariant=True, swiglu_limit=LIMIT),
        "fused_fast": lambda: fused_moe(*args, invariant=False, swiglu_limit=LIMIT),
        "fused_det_unclipped": lambda: fused_moe(*args, invariant=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096, 8192])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deepinfer.engine.layers.cuda_ops import CudaFastOps, CudaInvariantOps

    det, fast = CudaInvariantOps(), CudaFastOps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen).bfloat16() / HIDDEN ** 0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen).bfloat16() / INTER ** 0.5
    out = JsonOut(args.out)
    report = {"gpu": torch.cuda.get_device_name(), "shape": dict(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN,
                                                                 inter=INTER, swiglu_limit=LIMIT)}
    for n in args.tokens:
        x = torch.randn(n, HIDDEN, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(n, EXPERTS, device="cuda", generator=gen)
        ids = scores.topk(TOP_K, dim=-1).indices.sort(dim=-1).values.contiguous()
        w = (scores.gather(1, ids) + 0.1).contiguous()
        row = {arm: _time(fn, args.iters) for arm, fn in _arms((x, ids, w, gate_up, down), det, fast).items()}
        row["speedup_det"] = row["per_expert_det"]["median"] / row["fused_det"]["median"]
        row["speedup_fast"] = row["per_expert_fast"]["median"] / row["fused_fast"]["median"]
        out.line({"tokens": n, **row})
        report[f"tokens_{n}"] = row
    out.summary(report)


if __name__ == "__main__":
    main()
