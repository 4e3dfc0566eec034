"""Split-KV paged attention against the one-program form (kernels/paged_attention.py, issue 12): decode steps
of long rows in small and large batches, the prefill of long prompts, and the bits.

    python3 benchmarks/attn_split.py [--shapes qwen0.5b,llama8b] [--out attn_split.json]

For each head shape (benchmarks/attn_variants.py's SHAPES) and cache (bf16, e4m3) it times, in CUDA graphs
(20 calls per graph, median of 5 replays), the policies:
- one_program: NO_SPLIT, the form every row took before split-KV;
- default: `attention_split_policy` of the shape (from SPLIT_FROM, except a 16-bit cache with 128-dim heads,
  which does not split by default);
- from_1k / from_512 / from_256: splits forced from 1,024 / 512 / 256 positions (at most 8), for the family
  the default leaves alone and to see whether the 0.5B benchmark step gains: 256 rows at ~640 positions are
  512 programs of 5-6 key tiles, of which 3 fit an SM (1.3 waves on 132 SMs).
Decode steps run the CUDA-graph form (the static decode plan; split_kv set as the runner sets it); prefill
steps the host plan's split programs, or, for the tiles with MERGE_IN_PLACE, programs that merge their rows'
ranges themselves. `same_bits`: decode rows of 24 random-length sequences (up to 2,600 positions) equal their
rows of a full prefill and of chunks with random starts under that policy. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attn_variants import SHAPES, _decode_operands, _prefill_operands, _Sched  # noqa: E402
from benchmarks.common import finish_sweep  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

DECODE_CASES = [(1, 8192), (4, 8192), (16, 4096), (64, 2048), (256, 2048), (256, 640)]
PREFILL_CASES = [(1, 8192), (4, 2048)]   # (prompts, tokens each)


def _policies(cfg: dict) -> dict:
    from deepinfer.kernels.paged_attention import attention_split_policy
    from deepinfer.kernels.split_plan import NO_SPLIT, SplitPolicy

    n = cfg["BLOCK_N"]
    return {"one_program": NO_SPLIT, "default": attention_split_policy(cfg),
            "from_1k": SplitPolicy(max(1, 1024 // n), 8), "from_512": SplitPolicy(max(1, 512 // n), 8),
            "from_256": SplitPolicy(max(1, 256 // n), 8)}


def _call(ops: dict, cfg: dict, policy):
    from deepinfer.kernels.paged_attention import launch_paged_attention

    return lambda o=ops: launch_paged_attention(o["q"], o["kc"], o["vc"], o["meta"], o["scale"], o["ks"],
                                                o["vs"], cfg, split=policy)


def _splits(policy, cfg: dict, last_pos: int) -> int:
    import numpy as np
    from deepinfer.kernels.split_plan import split_counts

    return int(split_counts(np.array([last_pos]), cfg["BLOCK_N"], policy.min_tiles, policy.max_splits)[0])


def main(argv: list[str] | None = None) -> int:
    from deepinfer.kernels.paged_attention import attention_tile_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen0.5b,llama8b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--caches", default="bf16,e4m3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--policies", default=None,
                    help="comma-separated, of default, from_1k, from_512, from_256 (all); one_program, "
                         "the ratios' base, always runs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attn_split.py needs a CUDA GPU")
    start = time.time()
    rows = []
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        for cache in args.caches.split(","):
            fp8 = cache == "e4m3"
            dec_cfg, pre_cfg = (attention_tile_config(sh.group, sh.d, torch.bfloat16, kv_fp8=fp8, decode=d)
                                for d in (True, False))
            pols = _policies(dec_cfg)
            if args.policies:
                pols = {k: v for k, v in pols.items() if k in args.policies.split(",") or k == "one_program"}
            sched = _Sched(sh, fp8, max_len=2600)
            for pol_name, pol in pols.items():
                base = {"shape": name, "cache": cache, "policy": pol_name,
                        "min_tiles": pol.min_tiles, "max_splits": pol.max_splits}
                rows.append(dict(base, case="bits", same_bits=sched.check(dec_cfg, pre_cfg, pol)[0]))
                print(json.dumps(rows[-1]), flush=True)
                for batch, context in DECODE_CASES:
                    ops = _decode_operands(sh, batch, context, fp8)
                    ops["meta"].split_kv = _splits(pol, dec_cfg, context - 1) > 1
                    sec = graph_time(_call(ops, dec_cfg, pol))
                    kv = 2 * batch * context * sh.hkv * sh.d * ops["kc"].element_size()
                    rows.append(dict(base, case=f"decode {batch}x{context}", us=sec * 1e6,
                                     kv_gb_s=kv / sec / 1e9, splits=_splits(pol, dec_cfg, context - 1)))
                    print(json.dumps(rows[-1]), flush=True)
                for seqs, prompt in PREFILL_CASES:
                    ops = _prefill_operands(sh, fp8, seqs=seqs, prompt=prompt)
                    sec = graph_time(_call(ops, pre_cfg, pol))
                    rows.append(dict(base, case=f"prefill {seqs}x{prompt}", us=sec * 1e6))
                    print(json.dumps(rows[-1]), flush=True)
    base_us = {(r["shape"], r["cache"], r["case"]): r["us"] for r in rows
               if r["policy"] == "one_program" and "us" in r}
    print("| shape | cache | case | " + " | ".join(f"{p} µs (×)" for p in _policies({"BLOCK_N": 16})) + " |")
    print("|---|---|---|" + "---|" * len(_policies({"BLOCK_N": 16})))
    keys = sorted({(r["shape"], r["cache"], r["case"]) for r in rows if "us" in r}, key=str)
    for key in keys:
        cells = []
        for pol in _policies({"BLOCK_N": 16}):
            r = next((r for r in rows
                      if (r["shape"], r["cache"], r["case"]) == key and r["policy"] == pol), None)
            cells.append(f"{r['us']:.1f} ({base_us[key] / r['us']:.2f}×)" if r and "us" in r else "")
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    for r in rows:
        if r["case"] == "bits":
            print(f"bits {r['shape']} {r['cache']} {r['policy']}: {r['same_bits']}")
    return finish_sweep(rows, args.out, start)


if __name__ == "__main__":
    raise SystemExit(main())
