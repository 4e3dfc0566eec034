"""The one-pass sampling kernel at the Qwen2.5-0.5B decode step (256 rows x 151,936 logits), in CUDA graphs.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python3 benchmarks/sampling_05b.py --out sampling_05b.json      # ~20 s

Per case (greedy; temperature 0.8 with the Gumbel draw; temperature with a grammar bitmask on every row) and
logits dtype (bf16: what the engine's step now hands the sampler; float32: what it used to, after a cast) it
times `kernels.sampling.sample_tokens` with its default launch and, on bf16, a few alternative (split,
num_warps) launches (speed only: the ids must not change), reports us per call and GB/s of logits read,
and checks the ids against the plain-torch reference on the same device (`sample_tokens_ref`, bit for
bit). It also times the bf16 -> float32 cast of the logits that the step made before sampling (now gone).
Before this change the profiled decode step spent 142 us in the kernel (float32 logits) + 111 us in the cast.
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8_gemm_timing import graph_time

DEV = "cuda"
ROWS, VOCAB = 256, 151936
LAUNCHES = ((None, None), (8192, 8), (4096, 4), (16384, 4), (16384, 8))   # (split, warps); None: default


def graph_us(fn) -> float:
    """us per call of `fn` in a CUDA graph (benchmarks/fp8_gemm_timing.py: 20 calls, median of 5 replays)."""
    return graph_time(fn) * 1e6


def inputs(case: str, seed: int = 0):
    from deepinfer.kernels.reference.sampling import pack_row_params

    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen, device=DEV) * 3
    temps = [0.0 if case == "greedy" else 0.8] * ROWS
    rp = pack_row_params(temps, list(range(7, 7 + ROWS)), list(range(100, 100 + ROWS))).to(DEV)
    bitmask = slots = None
    if case == "temperature_bitmask":
        words = (VOCAB + 31) // 32
        bitmask = torch.randint(-2**31, 2**31, (ROWS, words), generator=gen, device=DEV).to(torch.int32)
        slots = torch.arange(ROWS, device=DEV)
    return logits, rp, bitmask, slots


def main() -> None:
    from deepinfer.kernels.reference.sampling import sample_tokens_ref
    from deepinfer.kernels.sampling import sample_tokens

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["greedy", "temperature", "temperature_bitmask"])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    for case in args.cases:
        logits32, rp, bm, slots = inputs(case)
        for dtype in (torch.bfloat16, torch.float32):
            logits = logits32.to(dtype)
            want = sample_tokens_ref(logits, rp, bm, slots)
            # Alternative launches on bf16 only (each is a compile; float32 is the old path's dtype).
            for split, warps in LAUNCHES if dtype == torch.bfloat16 else LAUNCHES[:1]:
                row = {"case": case, "dtype": str(dtype).removeprefix("torch."), "split": split or "default",
                       "num_warps": warps or "default"}
                try:
                    def call(logits=logits, rp=rp, bm=bm, slots=slots, split=split, warps=warps):
                        return sample_tokens(logits, rp, bm, slots, split=split, num_warps=warps)

                    row["ids_equal_ref"] = bool(torch.equal(call(), want))
                    us = graph_us(call)
                    row.update(us=round(us, 2), logits_GBps=round(logits.numel() * logits.element_size()
                                                                  / (us * 1e-6) / 1e9, 1))
                except Exception as e:   # a launch that does not fit is recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                results.append(row)
                print(json.dumps(row), flush=True)
    bf16 = logits32.to(torch.bfloat16)
    cast_us = graph_us(lambda: bf16.to(torch.float32))
    print(json.dumps({"cast_bf16_to_fp32_us": round(cast_us, 2)}), flush=True)
    out = {"device": torch.cuda.get_device_name(), "rows": ROWS, "vocab": VOCAB, "cast_us": cast_us,
           "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if not all(r.get("ids_equal_ref", True) for r in results):
        raise SystemExit("kernel ids differ from the torch reference (see ids_equal_ref)")


if __name__ == "__main__":
    main()
