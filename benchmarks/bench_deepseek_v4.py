"""DeepSeek-V4 on one GPU: deepinfer vs HF transformers, random weights, long prompts; KV bytes and capacity.

Run on an H200 (HF's DeepSeek-V4 needs transformers >= 5.2x; without it the HF arm is skipped, said so):
    python benchmarks/bench_deepseek_v4.py --out v4.json                 # 8k-token prompts, shape v4-h200
    python benchmarks/bench_deepseek_v4.py --quick                      # CPU, tiny shape, seconds
    python benchmarks/bench_deepseek_v4.py --arm hf --out v4_hf.json    # one arm per command
Both arms fit one 10-minute command: an arm starts only when it is expected to end within `--budget-s`
seconds (an MTP arm is expected to take what the first deepinfer arm took; skipped ones say so), and HF,
which runs prompts one at a time (so its tokens/s does not depend on how many), runs the first
`--hf-prompts` of them.
The deepinfer arm also runs with MTP drafting on (`--mtp-draft-lens`, default 1,3; '' for none): the dummy
checkpoint's random MTP block, so it measures the draft + verify cost, and checks the tokens equal MTP off.
Each arm loads once, warms up, then runs `--runs` measured repetitions (median, min, max). Per phase, the
deepinfer arm reports its load and warm-up seconds, the host seconds of its prefill and decode steps, and
(one more run, `--no-phases` to skip) the device milliseconds per model part (benchmarks/v4_phases.py).
Both arms get the same random prompts and produce `--output-len` tokens each (ignore_eos / min_new_tokens).
Reported besides throughput: KV-cache bytes per sequence of prompt + output tokens in deepinfer's layout,
the same for a full-attention layout (one shared K=V head per token and layer, what V4's MQA would cache
without windows or compression), and the maximum concurrent sequences each fits in deepinfer's KV budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from common import JsonOut, StepRecorder, spread, sync
from v4_phases import PhaseTimer

# A V4 shape that fits one H200 in bf16 with HF's copy beside it (~8.4e9 parameters each): V4-Flash's
# attention (64 heads of 512, q LoRA 1024, 8 output groups, indexer 64 x 128, top-512, window 128) with
# fewer layers and experts.
V4_H200 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "partial_rotary_factor": 0.125,
    "num_experts_per_tok": 6,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "layer_types": ["heavily_compressed_attention"] * 2
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 5,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "max_position_embeddings": 65536,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
V4_TINY = {
    **V4_H200,
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 24,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe"] * 2 + ["moe"] * 2,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def write_model_dir(cfg: dict, root: Path) -> Path:
    from deepinfer.engine.models.demo import write_tokenizer_files

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    write_tokenizer_files(root)
    return root


def kv_figures(llm, cfg: dict, seq_tokens: int) -> dict:
    """KV bytes per sequence of `seq_tokens` in deepinfer's layout (bounded: window + compressed pools), in
    its full layout (every token's rows), in a full-attention MQA cache (one K=V head per token and layer),
    and how many such sequences each fits in deepinfer's KV budget."""
    from deepinfer.engine.layers.v4_cache import v4_cache_spec

    spec, cache = llm.kv_cache_spec, llm.cache_cfg
    bm = llm.engine.scheduler.block_manager
    budget = cache.num_blocks * spec.bytes_per_block
    ours = spec.bytes_per_seq(seq_tokens)
    if spec.bounded:
        aux_per_seq = -(-(seq_tokens // spec.entry_rate) // cache.block_size)
        fits = min(cache.num_blocks // spec.window_blocks_per_seq(), bm.num_aux_blocks // aux_per_seq)
    else:
        fits = budget // ours
    full = v4_cache_spec(llm.model_config, cache.block_size, spec.dtype).bytes_per_seq(seq_tokens)
    elem = torch.tensor([], dtype=spec.dtype).element_size()
    mqa = seq_tokens * cfg["num_hidden_layers"] * cfg["head_dim"] * elem
    return {
        "bounded": spec.bounded,
        "kv_bytes_per_seq": ours,
        "full_layout_kv_bytes_per_seq": full,
        "full_attention_kv_bytes_per_seq": mqa,
        "kv_budget_bytes": budget,
        "max_concurrent_seqs": fits,
        "full_layout_max_concurrent_seqs": budget // full,
        "full_attention_max_concurrent_seqs": budget // mqa,
        "replay_span_tokens": spec.replay_span,
    }


def bench_deepinfer(
    model_dir: Path,
    cfg: dict,
    prompts,
    output_len: int,
    runs: int,
    device: str,
    dtype: str,
    out: JsonOut,
    draft_len: int = 0,
    phases: bool = True,
    deterministic: bool = False,
) -> dict:
    """One deepinfer arm; `draft_len` > 0 turns MTP drafting on (the dummy checkpoint's random MTP block,
    always drafting `draft_len` tokens: acceptance is near 0, so this measures the draft + verify cost)."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.spec_decode.config import MTPConfig

    mtp = None
    if draft_len:
        mtp = MTPConfig(max_draft_len=draft_len, confidence_threshold=0.0, auto_disable=False)

    # The bounded layout (window blocks released, compressed entries kept); random prompts share nothing.
    t_load = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        device=device,
        load_format="dummy",
        deterministic=deterministic,
        enable_prefix_caching=False,
        max_model_len=len(prompts[0]) + output_len + 16,
        max_num_seqs=len(prompts),
        gpu_memory_utilization=0.85,
        cpu_kv_cache_gib=0.25,
        speculative_mtp=mtp if mtp is not None else False,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync()
    load_s, t0 = time.perf_counter() - t_load, time.perf_counter()
    # Warm-up: two prompts, a few decode steps (compiles every kernel; batch sizes only change grids).
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    sync()
    phase = {"load_s": load_s, "warmup_s": time.perf_counter() - t0}
    out.line({"arm": "deepinfer", "draft_len": draft_len, **phase})
    rec = StepRecorder(llm)
    times = []
    for i in range(runs):
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        sync()
        rec.end()
        times.append(time.perf_counter() - t0)
        assert all(len(o.token_ids) == output_len for o in outs)
        out.line({"arm": "deepinfer", "draft_len": draft_len, "run": i, "seconds": times[-1]})
    phase["steps"] = rec.host_summary()  # host seconds of prefill / decode steps over the measured runs
    if phases:
        with PhaseTimer(llm.model) as timer:
            sync()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            sync()
        phase["timed_run_s"] = time.perf_counter() - t0
        phase["device_ms_by_part"] = timer.summary()
    out.line({"arm": "deepinfer", "draft_len": draft_len, "phases": phase})
    tokens = len(prompts) * (len(prompts[0]) + output_len)
    res = {
        "phases": phase,
        "seconds": spread(times),
        "tokens_per_s": tokens / sorted(times)[len(times) // 2],
        "output_tokens_per_s": len(prompts) * output_len / sorted(times)[len(times) // 2],
        **kv_figures(llm, cfg, len(prompts[0]) + output_len),
        "token_ids": [o.token_ids for o in outs],
    }
    if mtp is not None:
        stats = llm.get_stats()
        res["mtp"] = {k: stats[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens",
                                            "spec_acceptance_rate", "spec_mean_tokens_per_verify_step")}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the next arm (or HF) the memory back
    return res


def bench_hf(
    model_dir: Path,
    prompts,
    output_len: int,
    runs: int,
    device: str,
    dtype: torch.dtype,
    out: JsonOut,
    deadline: float = float("inf"),
) -> dict:
    try:
        import transformers as tf
    except ImportError as e:
        return {"skipped": f"transformers not importable: {e}"}
    if not hasattr(tf, "DeepseekV4ForCausalLM"):
        return {"skipped": f"transformers {tf.__version__} has no DeepSeek-V4 (needs >= 5.2x)"}
    cfg = tf.AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "eager"
    with torch.device(device):
        model = tf.DeepseekV4ForCausalLM._from_config(cfg, dtype=dtype).eval()
    times = []
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(
            ids[:1],
            attention_mask=torch.ones_like(ids[:1]),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
        )
        for i in range(runs):
            sync()
            t0 = time.perf_counter()
            for j, row in enumerate(ids.split(1)):  # one at a time: eager attention over 8k is memory-bound
                model.generate(row, attention_mask=torch.ones_like(row), **kw)
                sync()
                out.line({"arm": "hf", "run": i, "prompt": j, "elapsed_s": time.perf_counter() - t0})
            times.append(time.perf_counter() - t0)
            out.line({"arm": "hf", "run": i, "seconds": times[-1]})
            if time.perf_counter() > deadline:  # a measured run is enough to report; keep within budget
                break
    tokens = len(prompts) * (len(prompts[0]) + output_len)
    del model
    gc.collect()
    return {
        "version": tf.__version__,
        "seconds": spread(times),
        "tokens_per_s": tokens / sorted(times)[len(times) // 2],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU (float32): a smoke run")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--hf-prompts", type=int, default=2, help="prompts the HF arm runs (one at a time)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="start no arm expected to end after this many seconds (nor another HF run)")
    ap.add_argument("--no-phases", action="store_true", help="skip the extra run timing each model part")
    ap.add_argument("--deterministic", action="store_true",
                    help="deepinfer in batch-invariant mode (default: fast mode, cuBLAS matmuls)")
    ap.add_argument(
        "--arm",
        choices=("both", "deepinfer", "hf"),
        default="both",
        help="run one arm only (each fits one 10-minute GPU command)",
    )
    ap.add_argument(
        "--mtp-draft-lens",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 3],
        help="deepinfer arms with MTP drafting on at these draft lengths ('' for none)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        cfg, device, dtype = V4_TINY, "cpu", "float32"
        torch.set_num_threads(1)  # tiny ops: intra-op threads only spin on a shared CPU
        args.prompt_len, args.num_prompts, args.output_len = min(args.prompt_len, 96), 4, 8
    else:
        cfg, device, dtype = V4_H200, "cuda", "bfloat16"
    out = JsonOut(args.out)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        100, cfg["vocab_size"] - 100, (args.num_prompts, args.prompt_len), generator=g
    ).tolist()
    report = {
        "shape": "v4-tiny" if args.quick else "v4-h200",
        "device": device,
        "prompt_len": args.prompt_len,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "runs": args.runs,
        "deterministic": args.deterministic,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
    }
    start = time.perf_counter()
    deadline = start + args.budget_s

    def skipped(need: float = 0.0) -> dict | None:
        """A skip record when an arm expected to take `need` seconds would end past the budget."""
        spent = time.perf_counter() - start
        if time.perf_counter() + need <= deadline:
            return None
        return {"skipped": f"time budget: {spent:.0f} s spent, ~{need:.0f} s more needed, --budget-s "
                           f"{args.budget_s:.0f}"}

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(cfg, Path(tmp) / "v4")
        if args.arm in ("both", "deepinfer"):
            report["deepinfer"] = bench_deepinfer(
                model_dir, cfg, prompts, args.output_len, args.runs, device, dtype, out,
                phases=not args.no_phases, deterministic=args.deterministic,
            )
            base = report["deepinfer"].pop("token_ids")
            arm_s = time.perf_counter() - start  # what an MTP arm (no timed-parts run) takes at most
            for k in args.mtp_draft_lens:
                arm = skipped(arm_s) or bench_deepinfer(
                    model_dir, cfg, prompts, args.output_len, args.runs, device, dtype, out, draft_len=k,
                    phases=False, deterministic=args.deterministic,
                )
                if "skipped" not in arm:
                    # Greedy with MTP on must give the same tokens (verification is exact; fast mode may
                    # differ only where batch composition changes a bf16 near-tie: recorded, not hidden).
                    arm["same_tokens_as_mtp_off"] = arm.pop("token_ids") == base
                    arm["time_vs_mtp_off"] = (arm["seconds"]["median"]
                                              / report["deepinfer"]["seconds"]["median"])
                report[f"deepinfer_mtp_k{k}"] = arm
        if args.arm in ("both", "hf"):
            hf_prompts = prompts[: max(1, args.hf_prompts)]
            report["hf_num_prompts"] = len(hf_prompts)
            report["hf"] = skipped() or bench_hf(
                model_dir, hf_prompts, args.output_len, args.runs, device, getattr(torch, dtype), out,
                deadline=deadline,
            )
    report["wall_s"] = time.perf_counter() - start
    out.summary(report)


if __name__ == "__main__":
    main()
