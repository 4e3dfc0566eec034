"""DeepSeek-V2-Lite-shaped MoE + MLA throughput: deepinfer (deterministic, fast) beside HF transformers.

Run on the H200 (about 4-6 minutes; the HF arm is most of it):
    python benchmarks/bench_deepseek.py --out ds_v2lite.json
Smoke run on CPU with a tiny shape (proves the script end to end, seconds to a minute):
    python benchmarks/bench_deepseek.py --quick
CUDA graphs on vs off (decode steps as graphs vs eager), deterministic mode, bf16 and block-scaled FP8, one
engine per precision with the two arms interleaved on it (benchmarks/graphs_ab.py), about 4 minutes on the
H200 with the shortened default workload of this mode (128 x 512 -> 64: output-len 64 instead of 128):
    python benchmarks/bench_deepseek.py --graphs-ab --out ds_graphs_ab.json

Shape: 27 layers, hidden 2048, 16 heads, MLA (kv_lora_rank 512, q_lora_rank null, qk_nope 128, qk_rope 64,
v_head_dim 128), 64 routed experts top-6 + 2 shared (moe_intermediate_size 1408), first layer dense
(intermediate 10944), vocab 102400; random weights in bf16 (deepinfer `load_format="dummy"`, HF
`from_config`), the config written by transformers' own DeepseekV2Config. Same random prompts for every
arm, every request forced to `--output-len` tokens. Each arm: one full warm-up, then `--runs` measured runs
(median, min, max).

Reported per arm: out tok/s, total tok/s (prompt + output), the share of the compute ceiling (780 TFLOP/s
over 2 x active parameters per token: attention, the dense layer, top-6 + shared experts, lm_head) and, for
deepinfer, the decode steps' share of the bandwidth ceiling (4.2 TB/s over the bytes a decode step must
read: every weight but the routed experts, the experts the batch is expected to touch, and the latent KV).
Also the KV bytes per token (latent cache vs full per-head K/V) and the MTP verify-step cost proxy: the
time of one forward + logits with 1 + k query tokens per sequence (k = 1..3) vs 1 token, at the benchmark
batch size and mid-run context, driven directly through the model with the engine's own KV cache.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch
from common import (
    JsonOut,
    StepRecorder,
    add_rates,
    compare_arms,
    measure_hf_runs,
    measure_runs,
    profiled_run,
    spread,
    sync,
)
from graphs_ab import graphs_ab

CEILING_FLOPS = 780e12
CEILING_BYTES_S = 4.2e12

V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
               n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
               q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
               max_position_embeddings=4096, rms_norm_eps=1e-6)
TINY = dict(V2_LITE, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512)


def write_model_dir(shape: dict, root: Path) -> Path:
    """config.json written by transformers' DeepseekV2Config (the peer reads it too) + the demo tokenizer."""
    import transformers as tf
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = root / "deepseek"
    d.mkdir(parents=True, exist_ok=True)
    cfg = tf.DeepseekV2Config(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                              tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.save_pretrained(d)
    write_tokenizer_files(d)
    return d


def param_counts(s: dict) -> dict[str, float]:
    """Parameters per token (active) and in all, from the shape."""
    h, heads = s["hidden_size"], s["num_attention_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    attn = (h * heads * qk + h * (s["kv_lora_rank"] + s["qk_rope_head_dim"])
            + s["kv_lora_rank"] * heads * (s["qk_nope_head_dim"] + s["v_head_dim"])
            + heads * s["v_head_dim"] * h)
    expert = 3 * h * s["moe_intermediate_size"]
    dense_layers = s["first_k_dense_replace"]
    moe_layers = s["num_hidden_layers"] - dense_layers
    dense = dense_layers * 3 * h * s["intermediate_size"]
    router = moe_layers * s["n_routed_experts"] * h
    lm_head = s["vocab_size"] * h
    shared = moe_layers * s["n_shared_experts"] * expert
    active = (s["num_hidden_layers"] * attn + dense + router + shared
              + moe_layers * s["num_experts_per_tok"] * expert + lm_head)
    routed_all = moe_layers * s["n_routed_experts"] * expert
    total = active - moe_layers * s["num_experts_per_tok"] * expert + routed_all
    return {"active": float(active), "total": float(total + s["vocab_size"] * h),
            "non_routed": float(total - routed_all),
            "expert": float(expert), "moe_layers": float(moe_layers)}


def kv_bytes_per_token(s: dict, elem: int) -> dict[str, int]:
    layers, heads = s["num_hidden_layers"], s["num_attention_heads"]
    latent = layers * (s["kv_lora_rank"] + s["qk_rope_head_dim"]) * elem
    full = layers * heads * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"] + s["v_head_dim"]) * elem
    return {"ours_latent": latent, "full_per_head_kv": full, "ratio": full / latent}


def decode_step_bytes(s: dict, p: dict, batch: int, context: int, elem: int) -> float:
    """Bytes a decode step of `batch` sequences must read: weights (expected touched experts under uniform
    routing) plus the latent KV of every sequence's context."""
    e, k = s["n_routed_experts"], s["num_experts_per_tok"]
    touched = e * (1 - (1 - k / e) ** batch)
    weights = p["non_routed"] + p["moe_layers"] * touched * p["expert"]
    return weights * elem + batch * context * kv_bytes_per_token(s, elem)["ours_latent"]


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def mtp_verify_cost(llm, batch: int, context: int, max_draft: int, device: torch.device, iters: int) -> dict:
    """Median ms of a forward + logits with 1 + k new tokens per sequence (k = 0..max_draft), driven through
    the model with the engine's KV cache (idle after the runs), contexts of `context` cached positions."""
    from deepinfer.kernels.metadata import AttentionMetadata

    model, caches = llm.model, llm.engine.runner.kv_caches
    bs = llm.cache_cfg.block_size
    per_seq = -(-(context + max_draft + 1) // bs)
    if batch * per_seq > llm.cache_cfg.num_blocks:
        batch = llm.cache_cfg.num_blocks // per_seq
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    result: dict[str, dict] = {}
    for k in range(max_draft + 1):
        q = k + 1
        pos = torch.arange(context, context + q).repeat(batch)
        seq = torch.arange(batch).repeat_interleave(q)
        slots = tables[seq, pos // bs].long() * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(device), positions=pos.to(device),
            query_start_loc=(torch.arange(batch + 1, dtype=torch.int32) * q).to(device),
            seq_lens=torch.full((batch,), context + q, dtype=torch.int32, device=device),
            block_tables=tables.to(device), block_size=bs, max_query_len=q, max_seq_len=context + q,
            query_lens_cpu=[q] * batch, seq_lens_cpu=[context + q] * batch)
        ids = torch.randint(10, llm.model_config.vocab_size - 10, (batch * q,), device=device)
        times = []
        with torch.inference_mode():
            for i in range(iters + 2):
                sync()
                t0 = time.perf_counter()
                model.compute_logits(model(ids, meta.positions, meta, caches))
                sync()
                if i >= 2:   # two warm-ups: kernel compiles, allocator
                    times.append(1000 * (time.perf_counter() - t0))
        result[f"k={k}"] = {"ms": spread(times)}
    base = result["k=0"]["ms"]["median"]
    for k in range(1, max_draft + 1):
        result[f"k={k}"]["cost_vs_1_token"] = result[f"k={k}"]["ms"]["median"] / base
    return {"batch": batch, "context": context, "by_draft_len": result}


def _engine(model_dir: Path, prompts, args, *, deterministic: bool, quantization: str | None, **extra):
    """The benchmark's engine: dummy weights, room for every prompt at once, no prefix cache (the measured
    runs repeat the warm-up's prompts; HF recomputes their prefill too)."""
    from deepinfer.engine import LLM

    kw = (dict(gpu_memory_utilization=0.85) if args.device == "cuda" else dict(num_kv_blocks=256))
    return LLM(model=str(model_dir), dtype=args.dtype, device=args.device, load_format="dummy",
               deterministic=deterministic, quantization=quantization,
               max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=len(prompts),
               max_num_batched_tokens=16384, enable_prefix_caching=False, **kw, **extra)


def _quantization(name: str) -> str | None:
    """A --quantization / --quantizations entry as LLM(quantization=...): none and bf16 mean None."""
    return None if name in ("none", "bf16") else name


def bench_deepinfer(model_dir: Path, prompts, args, deterministic: bool, out: JsonOut, mode: str) -> dict:
    from deepinfer.engine import SamplingParams

    llm = _engine(model_dir, prompts, args, deterministic=deterministic,
                  quantization=_quantization(args.quantization))
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rec = StepRecorder(llm)
    seconds, first = measure_runs(llm, prompts, sp, rec, args.runs, out, mode)
    result = {"seconds": spread(seconds), "output_tokens": sum(map(len, first)), "steps": rec.host_summary(),
              "tokens": [t[:8] for t in first[:4]],
              "kv_cache": {"bytes_per_token": llm.kv_cache_spec.bytes_per_token,
                           "num_blocks": llm.cache_cfg.num_blocks}}
    if args.profile_steps:
        result["profile"] = profiled_run(llm, prompts, sp, rec)
    dev = torch.device(args.device)
    result["mtp_verify"] = mtp_verify_cost(llm, len(prompts), args.prompt_len + args.output_len // 2,
                                           3, dev, iters=args.mtp_iters)
    return result


def bench_graphs_ab(model_dir: Path, prompts, args, out: JsonOut, quantization: str | None) -> dict:
    """Deterministic mode, graphs on vs off on one engine (benchmarks/graphs_ab.py), greedy, every request
    `--output-len` tokens; out tok/s per arm from each run's seconds."""
    from deepinfer.engine import SamplingParams

    llm = _engine(model_dir, prompts, args, deterministic=True, quantization=quantization,
                  cuda_graph_capture="lazy")
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    label = f"deterministic-{quantization or 'bf16'}"
    r = graphs_ab(llm, prompts, sp, args.runs, out, label)
    for arm in ("eager", "graphs"):
        secs = r[arm]["seconds"]["runs"]
        r[arm]["out_tok_s"] = spread([r["output_tokens"] / t for t in secs])
    del llm
    return r


def run_graphs_ab(args, model_dir: Path, prompts, out: JsonOut) -> dict:
    rows = {}
    for q in args.quantizations.split(","):
        quant = _quantization(q)
        r = bench_graphs_ab(model_dir, prompts, args, out, quant)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        name = f"deterministic-{quant or 'bf16'}"
        rows[name] = r
        e, g = r["eager"], r["graphs"]
        ms = {a: (r[a]["decode_step_host_ms"] or {}).get("median", float("nan")) for a in ("eager", "graphs")}
        print(f"deepseek {'tiny' if args.quick else 'v2-lite'} {name}: eager out "
              f"{e['out_tok_s']['median']:.0f} tok/s (min {e['out_tok_s']['min']:.0f}, max "
              f"{e['out_tok_s']['max']:.0f}), graphs {g['out_tok_s']['median']:.0f} tok/s (min "
              f"{g['out_tok_s']['min']:.0f}, max {g['out_tok_s']['max']:.0f}): x{r['speedup_median']:.2f}; "
              f"decode step {ms['eager']:.1f} -> {ms['graphs']:.1f} ms; buckets {g['buckets']} captured in "
              f"{g['capture_seconds']:.1f} s; tokens identical: {r['tokens_identical']}", flush=True)
    return rows


def bench_hf(model_dir: Path, prompts, args, out: JsonOut) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids_all = torch.tensor(prompts, device=args.device)
    batch = args.hf_batch or len(prompts)
    with torch.no_grad():
        runs = args.hf_runs or args.runs
        seconds, n_out = measure_hf_runs(model, ids_all, batch, args.output_len, runs, out)
    impl = getattr(model.config, "_experts_implementation", None)
    return {"seconds": spread(seconds), "output_tokens": n_out, "experts_implementation": impl}


def _decode_bandwidth_share(r: dict, shape: dict, params: dict, args, elem: int) -> dict:
    decode = r["steps"].get("decode") if isinstance(r.get("steps"), dict) else None
    if not decode:
        return {"available": False}
    batch = args.num_prompts
    step_s = decode["host_ms_per_step"]["median"] / 1000
    need = decode_step_bytes(shape, params, batch, args.prompt_len + args.output_len // 2, elem)
    return {"available": True, "decode_step_ms_median": 1000 * step_s, "bytes_per_step": need,
            "share": need / CEILING_BYTES_S / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU, float32: a smoke run")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (64 with --graphs-ab)")
    ap.add_argument("--hf-batch", type=int, default=0, help="HF generate batch (0: all prompts at once)")
    ap.add_argument("--modes", default="deterministic,fast,hf")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per arm, after one warm-up run")
    ap.add_argument("--hf-runs", type=int, default=0, help="measured HF runs (0: --runs)")
    ap.add_argument("--mtp-iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="summary JSON here, one line per run in OUT.jsonl")
    ap.add_argument("--graphs-ab", action="store_true",
                    help="instead of --modes: CUDA graphs on vs off, deterministic, arms interleaved")
    ap.add_argument("--quantizations", default="none,fp8", help="--graphs-ab: engines to build (none, fp8)")
    ap.add_argument("--quantization", default="none",
                    help="--modes arms: LLM(quantization=...), e.g. fp8 (HF stays bf16)")
    ap.add_argument("--profile-steps", action="store_true",
                    help="one more run per deepinfer mode under torch.profiler: GPU busy, top kernels")
    args = ap.parse_args()
    shape = TINY if args.quick else V2_LITE
    if args.output_len is None:
        args.output_len = 64 if args.graphs_ab else 128
    if args.quick:
        args.num_prompts, args.prompt_len, args.output_len = 4, 24, 6
        args.mtp_iters = 3
    args.device = "cpu" if args.quick else "cuda"
    args.dtype = "float32" if args.quick else "bfloat16"
    elem = 4 if args.quick else 2

    model_dir = write_model_dir(shape, Path(tempfile.mkdtemp()))
    prompts = random_prompts(args.num_prompts, args.prompt_len, shape["vocab_size"])
    params = param_counts(shape)
    ceiling = CEILING_FLOPS / (2 * params["active"])
    total_in = args.num_prompts * args.prompt_len
    out = JsonOut(args.out)
    if args.graphs_ab:
        rows = run_graphs_ab(args, model_dir, prompts, out)
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        out.summary({"bench": "deepseek-graphs-ab", "date": date,
                     "quick": args.quick, "shape": shape, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "runs": args.runs, "results": rows})
        return
    rows = {}
    for mode in args.modes.split(","):
        if mode == "hf":
            r = bench_hf(model_dir, prompts, args, out)
        else:
            r = bench_deepinfer(model_dir, prompts, args, mode == "deterministic", out, mode)
            r["decode_bandwidth"] = _decode_bandwidth_share(r, shape, params, args, elem)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        add_rates(r, total_in, ceiling, "share_of_compute_ceiling")
        rows[mode] = r
        o = r["out_tok_s"]
        print(f"deepseek {'tiny' if args.quick else 'v2-lite'} {mode}: median {r['seconds']['median']:.2f}s "
              f"out {o['median']:.0f} tok/s "
              f"(min {o['min']:.0f}, max {o['max']:.0f}) total {r['total_tok_s']['median']:.0f} tok/s "
              f"({100 * r['share_of_compute_ceiling']:.1f}% of compute ceiling)", flush=True)
        if "mtp_verify" in r:
            by = r["mtp_verify"]["by_draft_len"]
            costs = ", ".join(f"{k}: {v['cost_vs_1_token']:.2f}x" for k, v in by.items() if k != "k=0")
            bw = r["decode_bandwidth"]
            share = f"{100 * bw['share']:.1f}%" if bw.get("available") else "n/a"
            print(f"  decode steps at {share} of the bandwidth ceiling; MTP verify forward (1+k tokens vs 1, "
                  f"{by['k=0']['ms']['median']:.1f} ms): {costs}", flush=True)
    compare_arms(rows)
    out.summary({"bench": "deepseek", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "quick": args.quick, "shape": shape, "params": params,
                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "torch": torch.__version__, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                 "output_len": args.output_len, "runs": args.runs, "compute_ceiling_tok_s": ceiling,
                 "kv_bytes_per_token": kv_bytes_per_token(shape, elem), "results": rows})


if __name__ == "__main__":
    main()
