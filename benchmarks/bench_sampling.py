"""Sampling micro-benchmark on one CUDA GPU: the one-pass Triton kernel vs the torch sampler path.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python benchmarks/bench_sampling.py --out sampling.json            # ~1 minute
    python benchmarks/bench_sampling.py --rows 1 64 256 --vocab 128256

Per case (rows x vocab float32 logits, Llama-3 vocabulary by default) it times `Sampler(use_kernel=True)`
against today's path, `Sampler(use_kernel=False)` (after kernels/masking.py's mask kernel for the bitmask
case), on the same logits and metadata (triton.testing.do_bench, median ms), checks their ids are equal, and
reports GB/s of logits read by the kernel path and the host time of building the step's metadata
(SamplingMetadata.from_params, with the kernel fields). Cases: temperature sampling, greedy, temperature
with a grammar bitmask on every row (fused into the kernel), a mix where 1 row in 8 uses top-p, and rows
that all filter (kernels/sampling_filter.py against the torch path's sort): top-p 0.9, top-k 50 with
top-p 0.95 (tests/engine/test_gpu_determinism.py's parameters), min-p 0.05.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

DEV = "cuda"
FILTERS = {"top_p": dict(temperature=0.8, top_p=0.9),
           "top_k_top_p": dict(temperature=0.9, top_k=50, top_p=0.95),
           "min_p": dict(temperature=0.7, min_p=0.05)}


def _ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _case(name: str, rows: int, vocab: int, seed: int = 0) -> dict:
    from deepinfer.engine.sample.metadata import SamplingMetadata
    from deepinfer.engine.sample.params import SamplingParams as SP
    from deepinfer.engine.sample.sampler import Sampler

    rng = random.Random(seed)
    if name == "greedy":
        params = [SP(temperature=0.0)] * rows
    elif name == "mixed_top_p":
        params = [SP(temperature=0.8, top_p=0.9) if i % 8 == 0 else SP(temperature=0.8) for i in range(rows)]
    elif name in FILTERS:
        params = [SP(**FILTERS[name])] * rows
    else:
        params = [SP(temperature=0.8)] * rows
    seeds = [rng.randrange(2**63) for _ in range(rows)]
    positions = [rng.randrange(512) for _ in range(rows)]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, device=DEV) * 3
    bitmask = slots = None
    if name == "temperature_bitmask":
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, device=DEV).to(torch.int32)
        slots = torch.arange(rows, device=DEV)

    def meta() -> SamplingMetadata:
        return SamplingMetadata.from_params(params, seeds, positions, vocab, DEV)

    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        m = meta()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    kernel, torch_path = Sampler(use_kernel=True), Sampler(use_kernel=False)
    if bitmask is None:
        def today() -> torch.Tensor:
            return torch_path(logits, m).token_ids
    else:
        # Today's flow: the Triton token-mask kernel masks the logits in place (idempotent, so the same
        # scratch copy serves every repetition), then the torch sampler runs on them.
        from deepinfer.kernels.masking import apply_token_bitmask_

        scratch = logits.clone()

        def today() -> torch.Tensor:
            apply_token_bitmask_(scratch, bitmask, None, slots)
            return torch_path(scratch, m).token_ids
    same = torch.equal(kernel(logits, m, bitmask, slots).token_ids, today())
    k_ms = _ms(lambda: kernel(logits, m, bitmask, slots))
    t_ms = _ms(today)
    return {
        "case": name, "rows": rows, "vocab": vocab, "ids_equal": same,
        "kernel_ms": round(k_ms, 4), "torch_ms": round(t_ms, 4), "speedup": round(t_ms / k_ms, 2),
        "kernel_logits_GBps": round(logits.numel() * 4 / (k_ms * 1e-3) / 1e9, 1),
        "metadata_host_ms_median": round(statistics.median(host), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--cases", nargs="+",
                    default=["temperature", "greedy", "temperature_bitmask", "mixed_top_p", *FILTERS])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    print("| case | rows | vocab | ids equal | kernel ms | torch ms | speedup | kernel GB/s "
          "| metadata host ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        for rows in args.rows:
            r = _case(name, rows, args.vocab)
            results.append(r)
            print(f"| {r['case']} | {rows} | {r['vocab']} | {r['ids_equal']} | {r['kernel_ms']} | "
                  f"{r['torch_ms']} | {r['speedup']}x | {r['kernel_logits_GBps']} | "
                  f"{r['metadata_host_ms_median']} |", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if not all(r["ids_equal"] for r in results):
        raise SystemExit("kernel and torch paths disagree (see ids_equal)")


if __name__ == "__main__":
    main()
