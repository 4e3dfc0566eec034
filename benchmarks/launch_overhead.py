"""Host time to launch one GEMM / RMSNorm, split into its parts: what a host-bound prefill step pays per op.

Run on the GPU machine from the repository root (after `pip install -e .`), a few seconds:
    python3 benchmarks/launch_overhead.py [--m 16384] [--calls 100] [--out launch.json]

Each arm is called --calls times back to back and timed on the host only (the device drains between
repetitions, and --calls is far below the launch queue's depth, so the host never waits for the device):
µs per call, median of --reps. Shapes are Qwen2.5-0.5B's qkv projection (896 -> 1152, with bias) and its
RMSNorm (hidden 896). Arms:
    torch.empty            the output allocation alone
    F.linear               cuBLAS (the fast mode's linear)
    ops.linear det         the deterministic engine's linear (CudaInvariantOps: planner + bi_linear)
    bi_linear config       bi_linear with its config given (no planner lookup)
    planner.config         the planner's M-bucket lookup alone
    tma_usable             the TMA check alone
    descriptors x2         the two TensorDescriptor objects alone
    tma kernel[grid]       the TMA GEMM kernel launched through Triton with descriptors built beforehand
    rms_norm               the RMSNorm wrapper (with residual)
    rms kernel[grid]       its kernel launched through Triton alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def host_us(fn, calls: int, reps: int) -> dict:
    """Host µs per call of `fn` (median and spread over `reps` batches of `calls`)."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return {"median": round(statistics.median(per), 2), "min": round(min(per), 2), "max": round(max(per), 2)}


def arms(m: int) -> dict:
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.kernels.matmul import MatmulPlanner, bi_linear
    from deepinfer.kernels.matmul_tma import _bi_linear_tma_kernel, tma_usable
    from deepinfer.kernels.rmsnorm import _rms_norm_kernel, rms_norm
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    n, k = 1152, 896
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    ops = make_ops(dev, True)
    planner = MatmulPlanner()
    cfg = planner.config(x, w, b)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk])
    programs = min(torch.cuda.get_device_properties(dev).multi_processor_count,
                   -(-m // bm) * -(-n // bn)) if cfg.persistent else -(-m // bm) * -(-n // bn)

    def tma_kernel():
        _bi_linear_tma_kernel[(programs,)](
            x_desc, w_desc, b, out, m, n, k, out.stride(0), out.stride(1), HAS_BIAS=True,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    h = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
    rout, rres = torch.empty_like(h), torch.empty_like(h)

    def rms_kernel():
        _rms_norm_kernel[(m,)](h, res, nw, rout, rres, k, 1e-6, h.stride(0), res.stride(0), rout.stride(0),
                               rres.stride(0), HAS_RESIDUAL=True, SINGLE_CHUNK=True, BLOCK=1024,
                               num_warps=4, enable_fp_fusion=False)

    return {
        "torch.empty": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=dev),
        "F.linear": lambda: F.linear(x, w, b),
        "ops.linear det": lambda: ops.linear(x, w, b),
        "bi_linear config": lambda: bi_linear(x, w, b, config=cfg),
        "planner.config": lambda: planner.config(x, w, b),
        "tma_usable": lambda: tma_usable(x, w),
        "descriptors x2": lambda: (TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk]),
                                   TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk])),
        "tma kernel[grid]": tma_kernel,
        "rms_norm": lambda: rms_norm(h, nw, 1e-6, residual=res),
        "rms kernel[grid]": rms_kernel,
    }, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead.py needs a CUDA GPU")
    table, cfg = arms(args.m)
    rows = {name: host_us(fn, args.calls, args.reps) for name, fn in table.items()}
    report = {"m": args.m, "config": str(cfg), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host_us": rows}
    print(f"M = {args.m}, qkv 896 -> 1152, config {cfg}")
    for name, r in rows.items():
        print(f"  {r['median']:8.1f} us  ({r['min']:.1f}-{r['max']:.1f})  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
