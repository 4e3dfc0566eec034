"""Offline throughput on the GPU: deepinfer (deterministic and fast modes) vs HF transformers, same prompts.

Run on a CUDA machine:
    python benchmarks/bench_throughput.py --shape llama-3.1-8b --num-prompts 256 --out results.json
    python benchmarks/bench_throughput.py --shape qwen2.5-0.5b --profile-steps --out tp_qwen.json

Each arm loads once, runs one full warm-up, then `--runs` measured runs (median, min, max reported);
`--interleave` keeps the deepinfer arms loaded side by side and takes their runs in turn.
`--profile-steps` adds one profiled run per deepinfer mode: GPU busy fraction and host ms per decode step.
`--profile X --profile-modes deterministic,fast` writes torch.profiler tables of a prefill-heavy run per mode
(X.deterministic, X.fast) and exits: where deterministic mode's extra time goes.
`--out X` writes the summary to X and one JSON line per run to X.jsonl.

Random weights (deepinfer: `load_format="dummy"`; HF: `from_config`), prompts of random token ids,
every request forced to `--output-len` tokens (ignore_eos / min_new_tokens). The compute ceiling is
780e12 / (2 * params) tokens/s (bf16 matmul measured on the H200; see shared GPU notes).

Prefix caching is off by default: the measured runs repeat the warm-up's prompts, and with the cache on
each run would take ~97% of its prompt tokens from the cache (HF recomputes them every time), so the
prompt tokens in "total tok/s" and the share of the ceiling would not have been computed. `--prefix-cache`
turns it on (how this benchmark ran until 2026-12-02, 03:30 UTC: its figures before then are mostly decode).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
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
    measured_run,
    profiled_run,
    spread,
    timed_generate,
)
from shapes import PARAMS, write_shape

# Arm suffixes (a mode "deterministic+pg+plaingc" takes both): the environment switch each sets for its arm.
ARM_SWITCHES = {"nopg": ("DEEPINFER_DISABLE_PREFILL_GRAPHS", "prefill steps eager (no prefill CUDA graphs)"),
                "plaingc": ("DEEPINFER_DISABLE_QUIET_GC", "CPython's collector defaults during runs"),
                "nopdl": ("DEEPINFER_DISABLE_PDL", "plain launches (no programmatic dependent launch)"),
                "nosk": ("DEEPINFER_DISABLE_SAMPLING_KERNEL", "the torch sampler (no sampling kernels)"),
                "queued": ("DEEPINFER_QUEUE_ALL_REQUESTS", "every request built before the first step"),
                "reduce": ("DEEPINFER_DISABLE_SPLIT_SUM_IN_NORM",
                           "split-K partials reduced in their own kernel, not in the next RMSNorm"),
                "noflat": ("DEEPINFER_DISABLE_GEMM_FLATTEN", "persistent GEMM tile loops not flattened"),
                "eagersplit": ("DEEPINFER_EAGER_SPLIT_PREFILL",
                               "prefill steps with split-KV rows eager (no split prefill graphs)")}
# Arm suffixes that move paged attention's split-KV threshold (kernels/paged_attention.SPLIT_FROM, 1,024) for
# the arm, where the shape's tiles split at all: an A/B of a layout change before it ships. Rows past the
# threshold change their bits, so such an arm's tokens are compared with its own first run only.
ARM_SPLIT_FROM = {"split512": (512, "split-KV from 512 positions"),
                  "split256": (256, "split-KV from 256 positions"),
                  "nosplit": (1 << 40, "no split-KV")}
# Arm suffixes that change what the arm samples (default: greedy), with their SamplingParams fields.
ARM_SAMPLING = {"topp": ({"temperature": 0.9, "top_k": 50, "top_p": 0.95},
                         "seeded sampling with top-k 50 and top-p 0.95 at T = 0.9"),
                "pen": ({"temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.2,
                         "frequency_penalty": 0.2}, "greedy with repetition 1.1, presence and frequency 0.2"),
                "pf": ({"temperature": 0.0, "presence_penalty": 0.2, "frequency_penalty": 0.2},
                       "greedy with presence and frequency 0.2 (the OpenAI API's penalties)")}


def arm_sampling(mode: str, max_tokens: int):
    """The SamplingParams of arm `mode`'s runs: greedy, or what its ARM_SAMPLING suffix names."""
    from deepinfer.engine import SamplingParams

    fields = {"temperature": 0.0}
    for suffix in mode.split("+")[1:]:
        fields = ARM_SAMPLING[suffix][0] if suffix in ARM_SAMPLING else fields
    return SamplingParams(**fields, max_tokens=max_tokens, ignore_eos=True)


@contextlib.contextmanager
def arm_env(mode: str):
    """The environment of arm `mode` ("deterministic" or "fast", then "+suffix"es of ARM_SWITCHES and
    ARM_SPLIT_FROM), set for the arm's whole life (the engine reads some switches when it is built, others
    per run)."""
    _, *suffixes = mode.split("+")
    names = [ARM_SWITCHES[x][0] for x in suffixes if x in ARM_SWITCHES]
    saved = {n: os.environ.pop(n, None) for n in (v[0] for v in ARM_SWITCHES.values())}
    os.environ.update({n: "1" for n in names})
    from deepinfer.kernels import paged_attention

    split_from = paged_attention.SPLIT_FROM
    for x in suffixes:
        paged_attention.SPLIT_FROM = ARM_SPLIT_FROM.get(x, (paged_attention.SPLIT_FROM,))[0]
    try:
        yield
    finally:
        paged_attention.SPLIT_FROM = split_from
        for n, v in saved.items():
            os.environ.pop(n, None)
            if v is not None:
                os.environ[n] = v

CEILING_FLOPS = 780e12


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def make_llm(model_dir: Path, prompts, output_len: int, deterministic: bool, prefix_cache: bool,
             quant: dict | None, step_tokens: int, kv_blocks: int | None = None):
    """The engine of one deepinfer arm (call inside its `arm_env`), after a short first call."""
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy",
              deterministic=deterministic, max_model_len=len(prompts[0]) + output_len + 16,
              max_num_seqs=len(prompts), max_num_batched_tokens=step_tokens, gpu_memory_utilization=0.85,
              enable_prefix_caching=prefix_cache, num_kv_blocks=kv_blocks, **(quant or {}))
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return llm


def bench_deepinfer(model_dir: Path, prompts, output_len: int, deterministic: bool, runs: int,
                    profile_steps: bool, out: JsonOut, mode: str, prefix_cache: bool = False,
                    quant: dict | None = None, step_tokens: int = 16384) -> dict:
    with arm_env(mode):
        llm = make_llm(model_dir, prompts, output_len, deterministic, prefix_cache, quant, step_tokens)
        sp = arm_sampling(mode, output_len)
        rec = StepRecorder(llm)
        seconds, first = measure_runs(llm, prompts, sp, rec, runs, out, mode)
        result = _result(llm, rec, seconds, first)
        if profile_steps:
            result["profile"] = profiled_run(llm, prompts, sp, rec)
    return result  # the engine goes with this frame; main() then frees its GPU memory


def bench_interleaved(model_dir: Path, prompts, output_len: int, modes: list[str], runs: int, out: JsonOut,
                      prefix_cache: bool, quant: dict | None, step_tokens: int) -> dict[str, dict]:
    """Every deepinfer arm's engine built first (each with a KV cache sized for this workload, so they fit
    side by side), warmed up, then run i of every arm before run i + 1 of any: a slow stretch of the
    shared host lands on all arms alike instead of on whichever arm was running."""
    blocks = len(prompts) * -(-(len(prompts[0]) + output_len + 16) // 16) + 64
    arms = {}
    for mode in modes:
        with arm_env(mode):
            llm = make_llm(model_dir, prompts, output_len, mode.startswith("deterministic"), prefix_cache,
                           quant, step_tokens, kv_blocks=blocks)
            rec = StepRecorder(llm)
            timed_generate(llm, prompts, arm_sampling(mode, output_len), rec)
            rec.reset()
            arms[mode] = (llm, rec, [], None)
    for i in range(runs):
        for mode, (llm, rec, seconds, first) in arms.items():
            with arm_env(mode):
                sp = arm_sampling(mode, output_len)
                dt, toks = measured_run(llm, prompts, sp, rec, out, mode, i, first)
            seconds.append(dt)
            arms[mode] = (llm, rec, seconds, first or toks)
    return {mode: _result(llm, rec, seconds, first) for mode, (llm, rec, seconds, first) in arms.items()}


def _result(llm, rec: StepRecorder, seconds: list[float], first: list[list[int]]) -> dict:
    return {"seconds": spread(seconds), "output_tokens": sum(map(len, first)), "steps": rec.host_summary(),
            "tokens": [t[:8] for t in first[:4]], "stats": _stats(llm)}


def _stats(llm) -> dict:
    """The engine's own counters (loop mode, CUDA-graph buckets) when this version has them."""
    get = getattr(llm, "get_stats", None)
    return get() if get is not None else {}


def profile_deepinfer(model_dir: Path, prompts, deterministic: bool, out: str | None) -> None:
    """A run of every prompt with 16 output tokens under torch.profiler (mostly prefill at 512-token prompts):
    where the time goes (device kernels, host). Prefix caching is off: with it, the profiled run would take
    its prompts from the warm-up's cache and show decode steps only (as it did until 2026-12-03)."""
    from deepinfer.engine import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy",
              deterministic=deterministic, max_model_len=len(prompts[0]) + 64,
              max_num_seqs=len(prompts), gpu_memory_utilization=0.85, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    print(f"profiled generate: {dt:.2f}s for {len(prompts)} prompts x 16 tokens")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table)
    if out:
        by_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        Path(out).write_text(table + "\n\n" + by_cpu)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def bench_hf(model_dir: Path, prompts, output_len: int, batch: int, runs: int, out: JsonOut) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    ids_all = torch.tensor(prompts, device="cuda")
    with torch.no_grad():
        model.generate(ids_all[:2], attention_mask=torch.ones_like(ids_all[:2]), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        seconds, n_out = measure_hf_runs(model, ids_all, batch, output_len, runs, out)
    return {"seconds": spread(seconds), "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--modes", default="deterministic,fast,hf",
                    help="arms: deterministic, fast, hf; +nopg (eager prefill), +plaingc (default GC), "
                         "+nopdl (no PDL), +nosk (torch sampler), +queued (no request feed), "
                         "+reduce (split-K reduced apart from the norm), +noflat (GEMM tile loops not "
                         "flattened), +eagersplit (prefill steps with split-KV rows eager), "
                         "+split512 / +split256 (split-KV from 512 / 256 positions), "
                         "+nosplit (none), +topp (top-k 50 / top-p 0.95 sampling), "
                         "+pen (repetition / presence / frequency penalties), +pf (presence / frequency)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per arm, after one warm-up run")
    ap.add_argument("--profile-steps", action="store_true",
                    help="one more run per deepinfer mode under torch.profiler: GPU busy per decode step")
    ap.add_argument("--out", default=None, help="summary JSON here, one line per run in OUT.jsonl")
    ap.add_argument("--profile", default=None,
                    help="write a torch.profiler table of a prefill-heavy run here (one per mode of "
                         "--profile-modes: PROFILE.<mode>) and exit")
    ap.add_argument("--profile-modes", default="deterministic", help="modes --profile runs, comma-separated")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="keep prefix caching on (the measured runs then reuse the warm-up's prompt KV)")
    ap.add_argument("--quantization", default=None,
                    help="deepinfer arms only: LLM(quantization=...), e.g. fp8, fp8-channel (HF stays bf16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="deepinfer arms: tokens per engine step (prefill chunks + decodes)")
    ap.add_argument("--interleave", action="store_true",
                    help="deepinfer arms side by side in memory, their runs taken in turn (run i of every "
                         "arm before run i + 1): what a comparison of arms should use on a shared host")
    ap.add_argument("--kv-cache-dtype", default=None, help="deepinfer arms only: LLM(kv_cache_dtype=...)")
    args = ap.parse_args()
    quant = {k: v for k, v in (("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype))
             if v is not None}

    tmp = Path(tempfile.mkdtemp())
    model_dir = write_shape(args.shape, tmp)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab)
    if args.profile:
        for mode in args.profile_modes.split(","):
            if mode not in ("deterministic", "fast"):
                raise SystemExit(f"--profile-modes: {mode!r} is not deterministic or fast")
            print(f"== {mode}", flush=True)
            profile_deepinfer(model_dir, prompts, deterministic=mode == "deterministic",
                              out=f"{args.profile}.{mode}")
            gc.collect()
            torch.cuda.empty_cache()
        return
    out = JsonOut(args.out)
    total_in = args.num_prompts * args.prompt_len
    ceiling = CEILING_FLOPS / (2 * PARAMS[args.shape])
    modes = args.modes.split(",")
    for mode in modes:
        base, *suffixes = mode.split("+")
        unknown = base not in ("deterministic", "fast") or any(
            x not in ARM_SWITCHES and x not in ARM_SAMPLING and x not in ARM_SPLIT_FROM for x in suffixes)
        if mode != "hf" and unknown:
            known = ", ".join(f"+{k} ({v[1]})"
                              for k, v in {**ARM_SWITCHES, **ARM_SAMPLING, **ARM_SPLIT_FROM}.items())
            raise SystemExit(f"--modes: {mode!r} is not hf, or deterministic/fast with suffixes: {known}")
    together = {}
    if args.interleave:
        together = bench_interleaved(model_dir, prompts, args.output_len, [m for m in modes if m != "hf"],
                                     args.runs, out, args.prefix_cache, quant, args.max_num_batched_tokens)
    rows = {}
    for mode in modes:
        if mode in together:
            r = together[mode]
        elif mode == "hf":
            r = bench_hf(model_dir, prompts, args.output_len, args.hf_batch, args.runs, out)
        else:
            det = mode.startswith("deterministic")
            r = bench_deepinfer(model_dir, prompts, args.output_len, det, args.runs, args.profile_steps, out,
                                mode, args.prefix_cache, quant, args.max_num_batched_tokens)
        gc.collect()
        torch.cuda.empty_cache()
        add_rates(r, total_in, ceiling)
        rows[mode] = r
        o = r["out_tok_s"]
        print(f"{args.shape} {mode}: median {r['seconds']['median']:.2f}s out {o['median']:.0f} tok/s "
              f"(min {o['min']:.0f}, max {o['max']:.0f}) total {r['total_tok_s']['median']:.0f} tok/s "
              f"({100 * r['share_of_ceiling']:.1f}% of ceiling)", flush=True)
    compare_arms(rows)
    out.summary({"bench": "throughput", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "shape": args.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                 "output_len": args.output_len, "runs": args.runs, "ceiling_tok_s": ceiling, **quant,
                 "max_num_batched_tokens": args.max_num_batched_tokens,
                 "results": rows})


if __name__ == "__main__":
    main()
