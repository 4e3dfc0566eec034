"""FP8 benchmark (issue 16): GEMMs in CUDA graphs on Llama-3.1-8B layer shapes, the DeepSeek-V2-Lite routed
experts, a tile sweep, and end-to-end throughput of FP8 vs bf16 in the same process.

GEMMs (benchmarks/fp8_gemm_timing.py; µs per call, 20 calls captured per CUDA graph, median of 5 replays):
cuBLAS bf16, torch._scaled_mm rowwise (the FP8 ceiling), ours block-scaled (K loops 0, 1, 2), ours rowwise
(deterministic and fast tiles; alone also the single deterministic tile with pointer loads and the
invariant planner's M-bucket tile), each with the activation quantization included (`*_quant`) and alone
(`*_alone`), plus the quantizations alone; qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336 at M = 64, 256, 2048. MoE: the whole routed-expert op of DeepSeek-V2-Lite (64 experts, top-6,
hidden 2048, 1408) in FP8 vs bf16 at 64 / 256 / 2048 tokens. `--sweep`: benchmarks/fp8_block_sweep.py
(block-scaled candidates at --block-ms, bits against the reference config, peers, the bucket table to
paste into kernels/fp8_block_plan.py) then benchmarks/fp8_sweep.py (rowwise with pointer and TMA loads;
M = 64 / 256 / 2048 / 8192 unless --sweep-ms); --sweep-kernels, --sweep-loads and --sweep-budget-s (shared
by both) keep it short.
Fused activation quantization (benchmarks/fp8_fused_timing.py): RMSNorm -> FP8 (K = 4096) and SiLU-and-mul
-> FP8 (K = 14336) against the bf16 op and the op + quantize_rows, alone and with the consumer GEMM, at
M = 64 / 256 / 2048 (part of the GEMM part; `--fused-only` runs just that table, ~1 min).
End to end (`LLM.generate`, random weights via load_format="dummy", greedy, every request forced to its
length, one warm-up then `--runs` measured runs, medians): Llama-3.1-8B shape, 256 prompts x 512 tokens,
256 output tokens; DeepSeek-V2-Lite shape (benchmarks/bench_deepseek.py), 128 prompts x 512, 128 out.
The measured runs repeat the warm-up's prompts, so prefix caching is off by default (each run prefills its
prompts again, as a fresh job would); `--prefix-cache` keeps it on, how this benchmark ran until 2026-12-02,
03:30 UTC (its runs then took ~97% of their prompt tokens from the cache: mostly decode). Each record counts
`prompt_tokens_cached_last_run`.
Each record also has the engine's GEMM planner verdicts (which weight shapes use their M-bucket tiles).

On one H200 (estimates, not yet measured; each command is meant to stay under 8 minutes):
    python3 benchmarks/bench_fp8.py --json out/fp8_a.json     # GEMMs + MoE + bf16-det, fp8ch-det/fast: ~5 min
    python3 benchmarks/bench_fp8.py --skip-gemm --arms bf16-det,fp8-det,fp8ch-kv8-det --json out/fp8_b.json
    python3 benchmarks/bench_fp8.py --skip-gemm --arms ds-bf16-det,ds-fp8-det,ds-fp8-fast --json out/c.json
    python3 benchmarks/bench_fp8.py --sweep --skip-e2e --json out/fp8_sweep.json   # GEMMs + sweep, ~4 min
    python3 benchmarks/bench_fp8.py --skip-gemm --skip-e2e --sweep --sweep-kernels rowwise --sweep-quick \
        --sweep-budget-s 60 --json out/fp8_rowwise_sweep.json   # rowwise bucket tiles only, ~1 min
    python3 benchmarks/bench_fp8.py --fused-only --json out/fp8_fused.json    # fused quant table, ~1 min
    python3 benchmarks/bench_fp8.py --skip-gemm --arms bf16-det,fp8ch-det,fp8ch-unfused-det  # ~3.5 min
    python3 benchmarks/bench_fp8.py --skip-gemm --skip-e2e --sweep --sweep-kernels block \
        --sweep-budget-s 180 --json out/fp8_block_sweep.json   # block candidates, table to paste, <= 4 min
    python3 benchmarks/bench_fp8.py --skip-gemm --arms bf16-det,fp8-kv8-det,fp8-kv8-fast,fp8ch-kv8-det \
        --runs 3 --json out/fp8_block_e2e.json   # block-scaled FP8 end to end against bf16 / rowwise, ~5 min
    python3 benchmarks/bench_fp8.py --quick                   # CPU smoke test (about a minute)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fp8_gemm_timing import LLAMA_8B, MS, bench_gemms, bench_moe, gemm_table  # noqa: E402

LLAMA = dict(shape="llama-3.1-8b", prompts=256, prompt_len=512, out_len=256)
DEEPSEEK = dict(shape="deepseek-v2-lite", prompts=128, prompt_len=512, out_len=128)
ARMS = {
    "bf16-det": dict(LLAMA, quantization=None, deterministic=True),
    "bf16-fast": dict(LLAMA, quantization=None, deterministic=False),
    "fp8-det": dict(LLAMA, quantization="fp8", deterministic=True),           # block-scaled 128 x 128
    "fp8-fast": dict(LLAMA, quantization="fp8", deterministic=False),
    "fp8ch-det": dict(LLAMA, quantization="fp8-channel", deterministic=True),  # per channel: rowwise GEMM
    "fp8ch-fast": dict(LLAMA, quantization="fp8-channel", deterministic=False),
    # The rowwise linears quantizing their own input (the path before kernels/fp8_fused_quant.py).
    "fp8ch-unfused-det": dict(LLAMA, quantization="fp8-channel", deterministic=True,
                              env={"DEEPINFER_DISABLE_FUSED_FP8_QUANT": "1"}),
    "fp8ch-kv8-det": dict(LLAMA, quantization="fp8-channel", kv_cache_dtype="fp8", deterministic=True),
    "fp8ch-kv8-fast": dict(LLAMA, quantization="fp8-channel", kv_cache_dtype="fp8", deterministic=False),
    # The SwiGLU kept out of the gate_up GEMM's epilogue (the fused SiLU-and-mul quantizer; the same bits).
    "fp8ch-kv8-noswiglu-det": dict(LLAMA, quantization="fp8-channel", kv_cache_dtype="fp8",
                                   deterministic=True, env={"DEEPINFER_DISABLE_SWIGLU_EPILOGUE": "1"}),
    "fp8-kv8-det": dict(LLAMA, quantization="fp8", kv_cache_dtype="fp8", deterministic=True),
    "fp8-kv8-fast": dict(LLAMA, quantization="fp8", kv_cache_dtype="fp8", deterministic=False),
    # The block-scaled linears quantizing their own input (before kernels/fp8_group_quant.py).
    "fp8-unfused-det": dict(LLAMA, quantization="fp8", deterministic=True,
                            env={"DEEPINFER_DISABLE_FUSED_FP8_QUANT": "1"}),
    "ds-bf16-det": dict(DEEPSEEK, quantization=None, deterministic=True),
    "ds-fp8-det": dict(DEEPSEEK, quantization="fp8", deterministic=True),     # FP8 experts: grouped GEMM
    "ds-fp8-fast": dict(DEEPSEEK, quantization="fp8", deterministic=False),
}
DEFAULT_ARMS = "bf16-det,fp8ch-det,fp8ch-fast"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "bfloat16"}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _model_dir(shape: str, root: Path, quick: bool) -> Path:
    from deepinfer.engine.models.demo import write_tokenizer_files

    if quick and shape == "deepseek-v2-lite":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from benchmarks.bench_deepseek import TINY as TINY_DS
        from benchmarks.bench_deepseek import write_model_dir

        return write_model_dir(TINY_DS, root / "ds-tiny")
    if quick:
        d = root / "tiny"
        if not d.exists():
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps(TINY))
            write_tokenizer_files(d)
        return d
    if shape == "deepseek-v2-lite":
        sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_deepseek imports `common`
        from benchmarks.bench_deepseek import V2_LITE, write_model_dir

        return write_model_dir(V2_LITE, root / "ds")
    from benchmarks.shapes import write_shape

    return write_shape(shape, root)


def _run_arm(arm: str, runs: int, quick: bool, root: Path, prefix_cache: bool = False) -> dict:
    from deepinfer.engine import LLM, SamplingParams

    spec = dict(ARMS[arm])
    shape, n, prompt_len, out_len = (spec.pop(k) for k in ("shape", "prompts", "prompt_len", "out_len"))
    env = spec.pop("env", {})
    if quick:
        n, prompt_len, out_len = 8, 32, 8
    model_dir = _model_dir(shape, root, quick)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 10, (n, prompt_len), generator=gen).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    dev = "cpu" if quick else "cuda"
    mem = dict(num_kv_blocks=64) if quick else dict(gpu_memory_utilization=0.85)
    t0 = time.perf_counter()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)          # read when the engine builds its ops backend
    try:
        llm = LLM(model=str(model_dir), dtype="bfloat16", device=dev, load_format="dummy",
                  max_model_len=prompt_len + out_len + 16, max_num_seqs=n, max_num_batched_tokens=16384,
                  enable_prefix_caching=prefix_cache, **mem, **spec)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    startup = time.perf_counter() - t0
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: every batch shape seen once
    secs, first, same = [], None, True
    for _ in range(runs):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if dev == "cuda":
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
        toks = [o.token_ids for o in outs]
        same = same and (first is None or toks == first)
        first = first or toks
    tokens = sum(map(len, first))
    med = statistics.median(secs)
    planners, kv_blocks = _planner_verdicts(llm), llm.cache_cfg.num_blocks
    # The measured runs repeat the warm-up's prompts and prefix caching is on: how much of their prefill
    # the cache served (what the arm's time is made of).
    cached = sum(int(getattr(o, "metrics", {}).get("num_cached_tokens", 0)) for o in outs)
    return {"part": "e2e", "arm": arm, "shape": shape, "prompts": n, "prompt_len": prompt_len,
            "out_len": out_len, "output_tokens": tokens, "seconds": secs, "seconds_median": med,
            "out_tok_s": tokens / med, "out_tok_s_min": tokens / max(secs),
            "out_tok_s_max": tokens / min(secs), "startup_s": startup,
            "kv_blocks": kv_blocks, "same_tokens_every_run": same, "planner_verdicts": planners,
            "prompt_tokens": n * prompt_len, "prompt_tokens_cached_last_run": cached}


def _planner_verdicts(llm) -> dict[str, dict[str, bool]]:
    """Per GEMM planner of the engine's ops backend (bf16 `_planner`, FP8 rowwise `_fp8_planner`, FP8
    block-scaled `_block_planner`), which weight shapes use their M-bucket tiles (True) or one config for
    every M (False): whether the tuned tiles were in use in the arm."""
    ops = next((m.ops for m in llm.model.modules() if getattr(m, "ops", None) is not None), None)
    out = {}
    planners = (("bf16", "_planner"), ("fp8_rowwise", "_fp8_planner"), ("fp8_block", "_block_planner"))
    for name, attr in planners:
        planner = getattr(ops, attr, None)
        if planner is not None:
            out[name] = planner.verdicts()
    return out


def bench_e2e(arms: list[str], runs: int, quick: bool, prefix_cache: bool = False) -> list[dict]:
    """Each arm in turn (its engine freed before the next); a failing arm is recorded and skipped."""
    root = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    rows = []
    for arm in arms:
        try:
            rec = _run_arm(arm, runs, quick, root, prefix_cache)
        except Exception as e:  # noqa: BLE001 - keep the other arms' figures (e.g. one arm out of memory)
            rec = {"part": "e2e", "arm": arm, "error": f"{type(e).__name__}: {e}"}
        else:
            rows.append(rec)
        emit(rec)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _e2e_ratios(rows: list[dict]) -> dict[str, float]:
    """Each arm's out tok/s over its shape's bf16 deterministic arm of the same run."""
    base = {r["shape"]: r["out_tok_s"] for r in rows if r["arm"] in ("bf16-det", "ds-bf16-det")}
    return {r["arm"]: r["out_tok_s"] / base[r["shape"]] for r in rows if r["shape"] in base}


def _quick_gemms() -> list[dict]:
    """CPU smoke test of the arms' math: the references on tiny shapes (the kernels need a GPU)."""
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, quantize_fp8_channel, row_scales
    from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref, fp8_rowwise_linear_ref

    rows = []
    for name, (n, k) in {"qkv": (192, 128), "down": (128, 256)}.items():
        w = torch.randn(n, k) * 0.02
        x = torch.randn(16, k)
        q, inv = quantize_fp8_block(w, (128, 128))
        block = fp8_linear_ref(x, q, row_scales(inv, n, k, 128, (128, 128)))
        rowwise = fp8_rowwise_linear_ref(x, *quantize_fp8_channel(w))
        dense = x @ w.T
        rec = {"part": "gemm-quick", "layer": name,
               "block_rel_err": float((block - dense).abs().max() / dense.abs().max()),
               "rowwise_rel_err": float((rowwise - dense).abs().max() / dense.abs().max())}
        rows.append(rec)
        emit(rec)
    return rows


def _sweeps(args: argparse.Namespace, layers: dict[str, tuple[int, int]], result: dict,
            ap: argparse.ArgumentParser) -> None:
    """The block sweep (first: the one a bucket table waits on), then the rowwise one, sharing the budget."""
    from benchmarks.fp8_sweep import KERNELS, LOADS, sweep, sweep_table

    kernels = tuple(kn for kn in args.sweep_kernels.split(",") if kn)
    loads = tuple(ld for ld in args.sweep_loads.split(",") if ld)
    if set(kernels) - {*KERNELS, "block"} or set(loads) - set(LOADS):
        ap.error(f"--sweep-kernels of {(*KERNELS, 'block')}, --sweep-loads of {LOADS}")
    t0 = time.perf_counter()
    if "block" in kernels:
        from benchmarks.fp8_block_sweep import block_sweep, block_sweep_text

        block_ms = tuple(int(v) for v in args.block_ms.split(",") if v)
        result["block_sweep"] = block_sweep(layers, block_ms, emit, args.sweep_budget_s)
        print(block_sweep_text(result["block_sweep"]), flush=True)
        if args.block_table_out:
            args.block_table_out.parent.mkdir(parents=True, exist_ok=True)
            args.block_table_out.write_text(json.dumps(result["block_sweep"]["table"], indent=1))
    rowwise = tuple(kn for kn in kernels if kn != "block")
    if rowwise:
        spent = time.perf_counter() - t0
        budget = None if args.sweep_budget_s is None else max(0.0, args.sweep_budget_s - spent)
        sweep_ms = tuple(int(v) for v in args.sweep_ms.split(",") if v)
        names = tuple(n.strip() for n in args.sweep_names.split(",") if n.strip())
        result["sweep"] = sweep(layers, sweep_ms, emit, rowwise, loads, budget, names or args.sweep_quick,
                                args.sweep_promote)
        print(sweep_table(result["sweep"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shapes, torch references")
    ap.add_argument("--runs", type=int, default=3, help="measured end-to-end runs per arm (>= 3)")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"end-to-end arms, of {','.join(ARMS)}")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="end to end with prefix caching: the measured runs repeat the warm-up's prompts and "
                         "take their KV from the cache (by default each run prefills them again)")
    ap.add_argument("--skip-gemm", action="store_true", help="no GEMM / MoE timing")
    ap.add_argument("--sweep", action="store_true", help="also the tile sweep (benchmarks/fp8_sweep.py)")
    ap.add_argument("--sweep-ms", default="64,256,2048,8192", help="row counts the sweep times")
    ap.add_argument("--sweep-kernels", default="rowwise,block", help="of rowwise,block (block: "
                    "benchmarks/fp8_block_sweep.py, at --block-ms, its bucket table printed to paste)")
    ap.add_argument("--block-ms", default="1,16,64,128,256,2048,16384",
                    help="row counts the block sweep times")
    ap.add_argument("--block-table-out", type=Path, default=None,
                    help="write the block sweep's bucket table here as JSON (run it end to end with "
                         "DEEPINFER_FP8_BLOCK_TABLE=<file>, kernels/fp8_block_plan.py)")
    ap.add_argument("--sweep-loads", default="pointer,tma", help="rowwise tile loaders swept, of pointer,tma")
    ap.add_argument("--sweep-names", default="", help="only the rowwise candidates of these names "
                    "(comma-separated, e.g. '64x128x128 w4 s6 tma,128x256x128 w8 s3 tma pers')")
    ap.add_argument("--sweep-promote", type=int, default=0,
                    help="also each rowwise candidate with IMPRECISE_ACC=N (e.g. 128: the FP8 partial sums "
                         "promoted to fp32 every K tile; names end in 'imprecise_acc<N>' for --sweep-names)")
    ap.add_argument("--sweep-quick", action="store_true",
                    help="only the rowwise tiles a bucket table chooses between (fp8_sweep.QUICK_ROWWISE)")
    ap.add_argument("--sweep-budget-s", type=float, default=None,
                    help="stop starting new (layer, kernel) sweeps after this many seconds")
    ap.add_argument("--fused-only", action="store_true",
                    help="only the fused activation-quantization table (benchmarks/fp8_fused_timing.py)")
    ap.add_argument("--layers", default=",".join(LLAMA_8B), help="GEMM layers, of qkv,o,gate_up,down")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be >= 3 (medians of at least 3 runs)")
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    layers = {name: LLAMA_8B[name] for name in args.layers.split(",") if name}
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda and not args.quick:
        ap.error("needs a CUDA GPU (or --quick for the CPU smoke test)")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
                    "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    t_start = time.perf_counter()
    if args.fused_only or (cuda and not args.skip_gemm):
        if not cuda:
            ap.error("--fused-only needs a CUDA GPU")
        from benchmarks.fp8_fused_timing import bench_fused_quant, fused_table

        result["fused_quant"] = bench_fused_quant(emit)
        print(fused_table(result["fused_quant"]), flush=True)
    if args.fused_only:
        args.skip_gemm = args.skip_e2e = True
    if not args.skip_gemm:
        if cuda:
            result["gemm"] = bench_gemms(layers, MS, emit)
            result["moe"] = bench_moe(emit)
            print(gemm_table(result["gemm"]), flush=True)
        else:
            result["gemm"] = _quick_gemms()
    if args.sweep and cuda:
        _sweeps(args, layers, result, ap)
    if not args.skip_e2e:
        result["e2e"] = bench_e2e(arms, args.runs, args.quick, args.prefix_cache)
        result["e2e_vs_bf16_det"] = _e2e_ratios(result["e2e"])
        emit({"part": "e2e-summary", **result["e2e_vs_bf16_det"]})
    result["wall_s"] = time.perf_counter() - t_start
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
