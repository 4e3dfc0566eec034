"""The CPU path a new user runs first: deepinfer (deterministic default) vs HF transformers `generate`.

    python benchmarks/bench_cpu_chat.py --out cpu_chat.json            # 16 chats x 48 greedy tokens
    python benchmarks/bench_cpu_chat.py --profile-out cpu_profile.txt  # + a torch.profiler table

The model is a random-weight checkpoint of the SmolLM2-135M shape (Llama architecture: hidden 576, 30
layers, 9 heads / 3 kv heads, intermediate 1536, vocab 49152, tied embeddings), built with HF's own
`LlamaForCausalLM` and `save_pretrained` (safetensors) and cached under the temp dir, with deepinfer's demo
tokenizer. Both engines get the same chat-templated token ids and generate exactly `--max-tokens` greedy
tokens (EOS ignored on both sides, so random weights cannot end a row early). HF runs the 16 prompts as one
left-padded batch, its fastest way on CPU. The arms alternate (HF, deepinfer, HF, deepinfer, ...) after one
warm-up of each, so load from other processes on a shared machine falls on both alike; the figures are the
medians and the spread (min/max) of `--runs` runs. Greedy outputs are compared row by row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from common import spread

SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 2048, "hidden_act": "silu", "head_dim": 64,
}
# Bump when the checkpoint recipe changes so a stale cached copy is never reused.
CKPT_VERSION = "v1"


def build_checkpoint(dtype: str, root: Path | None = None) -> Path:
    """The cached SmolLM2-135M-shaped random checkpoint (HF classes, safetensors) + demo tokenizer."""
    from deepinfer.engine.models.demo import write_tokenizer_files
    from transformers import LlamaConfig, LlamaForCausalLM

    root = root or Path(tempfile.gettempdir()) / "deepinfer-bench"
    d = root / f"smollm2-135m-shape-{CKPT_VERSION}-{dtype}"
    if (d / "model.safetensors").is_file():
        return d
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=root))
    write_tokenizer_files(tmp)  # bos 0, eos 1, <|im_end|> 3, pad 4; ChatML template
    cfg = LlamaConfig(**SMOLLM2_135M, bos_token_id=0, eos_token_id=1, pad_token_id=4,
                      attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [1, 3]
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, d)  # atomic: concurrent builders never see a half-written directory
    return d


def chat_prompts(n: int) -> list[list[dict]]:
    """n single-turn chats built from the shipped corpus (deterministic, mixed lengths)."""
    from importlib import resources

    words = resources.files("deepinfer.engine.models").joinpath("data/demo_corpus.txt").read_text().split()
    chats = []
    for i in range(n):
        k = 6 + (i * 7) % 19  # 6..24 words: short chat turns
        start = (i * 911) % (len(words) - k)
        chats.append([{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Summarise: " + " ".join(words[start:start + k])}])
    return chats


def hf_generate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> list[list[int]]:
    """One left-padded greedy batch; returns each row's new tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both engines")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--arms", default="hf,deterministic", help="any of hf,deterministic,fast")
    ap.add_argument("--profile-out", default=None, help="also profile one deepinfer run; table written here")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="exit 0 even if a greedy row differs from HF's (default: exit 1, after reporting)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.text.tokenizer import Tokenizer
    from transformers import AutoModelForCausalLM

    model_dir = build_checkpoint(args.dtype)
    arms = args.arms.split(",")
    engines: dict = {}
    for arm in arms:
        if arm == "hf":
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
            hf.generation_config.eos_token_id = None  # generate exactly max_tokens, as ignore_eos does
            engines[arm] = hf
        else:
            # No prefix cache: the warm-up would otherwise leave every prompt cached and the measured
            # runs would skip prefill, which HF cannot do; a first run over new prompts gets no hits either.
            engines[arm] = LLM(model=str(model_dir), device="cpu", deterministic=(arm == "deterministic"),
                               enable_prefix_caching=False)
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in chat_prompts(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(arm: str) -> tuple[float, float, list[list[int]]]:
        t0, c0 = time.perf_counter(), time.process_time()
        if arm == "hf":
            toks = hf_generate(engines[arm], prompts, args.max_tokens, pad_id=4)
        else:
            toks = [o.token_ids for o in engines[arm].generate(prompts, sp, use_tqdm=False)]
        return time.perf_counter() - t0, time.process_time() - c0, toks

    tokens = {arm: run(arm)[2] for arm in arms}  # warm-up of each arm
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    # CPU seconds of this process: with --threads 1 on a machine shared with other jobs, far steadier
    # than wall time (waiting for a core is not counted); on a quiet machine the two agree.
    cpu_seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(args.runs):
        for arm in arms:
            dt, cpu, toks = run(arm)
            assert toks == tokens[arm], f"{arm}: run {i} gave different tokens than its warm-up"
            seconds[arm].append(dt)
            cpu_seconds[arm].append(cpu)
            pair = ""
            if arm != "hf" and len(seconds.get("hf", [])) > i:  # HF ran earlier in this round
                pair = (f"  ({seconds['hf'][i] / dt:.2f}x the HF run beside it; CPU time "
                        f"{cpu_seconds['hf'][i] / cpu:.2f}x)")
            tps = len(prompts) * args.max_tokens / dt
            print(f"run {i} {arm:13s} {dt:6.2f} s ({cpu:6.2f} s CPU)  {tps:6.1f} out tok/s{pair}", flush=True)
    n_out = len(prompts) * args.max_tokens
    results = {arm: {"seconds": spread(s), "cpu_seconds": spread(cpu_seconds[arm]),
                     "out_tok_s": spread([n_out / x for x in s])} for arm, s in seconds.items()}
    report: dict = {
        "bench": "cpu_chat", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "shape": SMOLLM2_135M,
        "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens,
        "results": results,
    }
    mismatched: list[str] = []
    if "hf" in results:
        hf_tps = results["hf"]["out_tok_s"]["median"]
        for arm in arms:
            if arm == "hf":
                continue
            results[arm]["ratio_to_hf"] = results[arm]["out_tok_s"]["median"] / hf_tps
            # Each run of an arm sits beside an HF run under the same load: their ratios drift less.
            results[arm]["pair_ratios_to_hf"] = spread([h / d for h, d in zip(seconds["hf"], seconds[arm])])
            results[arm]["per_run_ratios_to_hf"] = [round(h / d, 3)
                                                    for h, d in zip(seconds["hf"], seconds[arm])]
            results[arm]["per_run_cpu_time_ratios_to_hf"] = [round(h / d, 3) for h, d in
                                                             zip(cpu_seconds["hf"], cpu_seconds[arm])]
            same = sum(a == b for a, b in zip(tokens[arm], tokens["hf"]))
            results[arm]["rows_identical_to_hf"] = f"{same}/{len(prompts)}"
            print(f"{arm}: {results[arm]['ratio_to_hf']:.2f}x HF out tok/s (medians); per-run ratios "
                  f"{results[arm]['per_run_ratios_to_hf']}, median "
                  f"{results[arm]['pair_ratios_to_hf']['median']:.2f}x; CPU-time ratios "
                  f"{results[arm]['per_run_cpu_time_ratios_to_hf']}; greedy rows identical "
                  f"to HF: {same}/{len(prompts)}")
            mismatched.extend(f"{arm} row {r}" for r, (a, b) in enumerate(zip(tokens[arm], tokens["hf"]))
                              if a != b)
    if args.profile_out:
        report["profile"] = profile_one(engines, prompts, sp, args.profile_out)
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if mismatched and not args.allow_mismatch:
        raise SystemExit(f"greedy outputs differ from HF generate: {', '.join(mismatched)}")


def profile_one(engines: dict, prompts, sp, path: str) -> dict:
    """One deterministic deepinfer run under torch.profiler: the op table, and host time per step."""
    from torch.profiler import ProfilerActivity, profile

    llm = engines.get("deterministic") or next(e for k, e in engines.items() if k != "hf")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30,
                                                               max_name_column_width=50)
    Path(path).write_text(table)
    print(table)
    return {"profiled_seconds": dt, "table": path}


if __name__ == "__main__":
    main()
