"""FP8 benchmark: GEMM TFLOP/s on Llama-3.1-8B layer shapes and end-to-end 8B-shape throughput, FP8 vs bf16.

GEMMs (one H200, bf16 activations): bf16 cuBLAS (`x @ w.T`), torch._scaled_mm (e4m3, rowwise scales,
operands pre-quantized: the FP8 matmul ceiling), deepinfer's `fp8_linear` fast and invariant (activation
quantization included) on qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096 at
M in 1, 16, 64, 256, 2048. Medians of >= 3 timed runs (CUDA events, 20 calls each). MoE: DeepSeek-V2-Lite
expert shapes, FP8 grouped GEMM vs a bf16 per-expert cuBLAS loop (16 / 256 / 2048 tokens, top-6 of 64).
End to end: Llama-3.1-8B shape, random weights (`load_format="dummy"`), 256 prompts of 256 random tokens,
128 greedy output tokens; arms bf16 / FP8 weights (quantization="fp8") / FP8 weights + FP8 KV, deterministic
and fast; output tokens/s medians of 3 runs after a warm-up, all in the same process.

    python3 benchmarks/bench_fp8.py --json out/bench_fp8.json          # H200: about 5-6 minutes
    python3 benchmarks/bench_fp8.py --quick                            # CPU smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64, 256, 2048)
ARMS = {
    "bf16-det": dict(quantization=None, deterministic=True),
    "fp8-det": dict(quantization="fp8", deterministic=True),
    "fp8-fast": dict(quantization="fp8", deterministic=False),
    "fp8-kv8-det": dict(quantization="fp8", kv_cache_dtype="fp8", deterministic=True),
    "bf16-fast": dict(quantization=None, deterministic=False),
}
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "bfloat16"}


def _time(fn, runs: int, calls: int, cuda: bool) -> float:
    """Median seconds per call over `runs` timed runs of `calls` calls (after one warm-up run)."""
    fn()
    out = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def bench_gemms(quick: bool, runs: int) -> list[dict]:
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales
    from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref, quantize_act_ref

    cuda = torch.cuda.is_available() and not quick
    dev = "cuda" if cuda else "cpu"
    layers = LAYERS if not quick else {"qkv": (192, 128), "down": (128, 256)}
    ms = MS if not quick else (1, 16)
    rows = []
    for name, (n, k) in layers.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, inv = quantize_fp8_block(w, (128, 128))
        ws = row_scales(inv, n, k, 128, (128, 128))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * m * n * k
            arms = {"bf16_matmul": lambda x=x, w=w: x @ w.T}
            if cuda:
                from deepinfer.kernels.fp8_matmul import fp8_linear

                xq, xs = quantize_act_ref(x, k)  # one scale per row: the rowwise _scaled_mm operands
                ws_row = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
                wq_row = (w.float() / ws_row).clamp(-448, 448).to(torch.float8_e4m3fn)
                sb = ws_row.T.contiguous()
                arms["scaled_mm_rowwise"] = lambda xq=xq, wr=wq_row, xs=xs, sb=sb: torch._scaled_mm(
                    xq, wr.T, scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16)
                arms["fp8_linear_fast"] = lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws, invariant=False)
                arms["fp8_linear_invariant"] = lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws, invariant=True)
            else:
                arms["fp8_reference"] = lambda x=x, wq=wq, ws=ws: fp8_linear_ref(x, wq, ws)
            for arm, fn in arms.items():
                sec = _time(fn, runs, 20 if cuda else 2, cuda)
                row = {"layer": name, "m": m, "n": n, "k": k, "arm": arm, "seconds": sec,
                       "tflops": flops / sec / 1e12}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def bench_moe(quick: bool, runs: int) -> list[dict]:
    """DeepSeek-V2-Lite-sized experts (64 x [1408 -> 2048 down, 2048 -> 2816 gate_up], top-6): FP8 grouped
    GEMM vs a bf16 per-expert loop of cuBLAS matmuls over the same expert-sorted rows."""
    if quick or not torch.cuda.is_available():
        return []
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales
    from deepinfer.kernels.fp8_matmul import fp8_grouped_linear

    experts, top_k = 64, 6
    rows = []
    for name, (n, k) in {"gate_up": (2816, 2048), "down": (2048, 1408)}.items():
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, inv = quantize_fp8_block(w, (128, 128))
        ws = torch.stack([row_scales(inv[e], n, k, 128, (128, 128)) for e in range(experts)])
        for tokens in (16, 256, 2048):
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            ids = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=gen).sort().values
            counts = torch.bincount(ids, minlength=experts)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            bounds = offsets.tolist()
            x = torch.randn(tokens * top_k, k, device="cuda", dtype=torch.bfloat16)

            def bf16_loop(x=x, w=w, bounds=bounds):
                return [x[bounds[e]:bounds[e + 1]] @ w[e].T for e in range(experts)]

            flops = 2.0 * tokens * top_k * n * k
            arms = {"bf16_expert_loop": bf16_loop,
                    "fp8_grouped_invariant": lambda x=x, q=q, ws=ws, o=offsets: fp8_grouped_linear(
                        x, q, ws, o),
                    "fp8_grouped_fast": lambda x=x, q=q, ws=ws, o=offsets: fp8_grouped_linear(
                        x, q, ws, o, invariant=False)}
            for arm, fn in arms.items():
                sec = _time(fn, runs, 10, True)
                row = {"moe": name, "tokens": tokens, "arm": arm, "seconds": sec,
                       "tflops": flops / sec / 1e12}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def bench_e2e(quick: bool, runs: int, arms: list[str]) -> list[dict]:
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.models.demo import write_tokenizer_files

    from benchmarks.shapes import write_shape

    root = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    if quick:
        model_dir = root / "tiny"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(TINY))
        write_tokenizer_files(model_dir)
        n, prompt_len, out_len, vocab, dev = 8, 32, 8, TINY["vocab_size"], "cpu"
    else:
        model_dir = write_shape("llama-3.1-8b", root)
        n, prompt_len, out_len, vocab, dev = 256, 256, 128, 128256, "cuda"
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (n, prompt_len), generator=gen).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    rows = []
    for arm in arms:
        llm = LLM(model=str(model_dir), dtype="bfloat16", device=dev, load_format="dummy",
                  max_model_len=prompt_len + out_len + 16, max_num_seqs=n, max_num_batched_tokens=16384,
                  gpu_memory_utilization=0.85, **ARMS[arm])
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up: every batch shape seen once
        secs, tokens = [], None
        for _ in range(runs):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            if dev == "cuda":
                torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
            tokens = sum(len(o.token_ids) for o in outs)
        row = {"arm": arm, "output_tokens": tokens, "seconds_median": statistics.median(secs),
               "seconds": secs, "out_tok_s": tokens / statistics.median(secs),
               "kv_blocks": llm.cache_cfg.num_blocks}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm, outs
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shapes, torch reference")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--arms", default="bf16-det,fp8-det,fp8-fast,fp8-kv8-det",
                    help=f"end-to-end arms, of {','.join(ARMS)}")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true", help="only the end-to-end arms")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be >= 3 (medians of at least 3 runs)")
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick
              else "cpu",
              "torch": torch.__version__}
    if not args.skip_gemm:
        result["gemm"] = bench_gemms(args.quick, args.runs)
        result["moe"] = bench_moe(args.quick, args.runs)
    if not args.skip_e2e:
        result["e2e"] = bench_e2e(args.quick, args.runs, arms)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
