"""The job pipeline's overhead on the GPU: `deepinfer-job submit` (Ray Data + engine actors, or the
in-process executor) vs the engine alone, and length-sorted vs unsorted batches. Same rows, same model,
same sampling in every arm.

Run on a CUDA machine (1 GPU per engine actor; --engines defaults to every visible GPU):
    python benchmarks/bench_pipeline.py --shape llama-3.2-1b --rows 4096 --out pipeline.json
    python benchmarks/bench_pipeline.py --model /models/Llama-3.1-8B-Instruct --rows 2048
    python benchmarks/bench_pipeline.py --shape llama-3.1-8b --rows 4096 --arms engine,local,sorted

Arms:
  engine    LLM.generate over all pre-tokenized prompts at once (one process, one GPU): the ceiling.
  sorted    the full pipeline on Ray (runtime.executor=ray: read -> prompt -> tokenize + length sort over
            the whole input -> engine actors).
  unsorted  the same with runtime.sort_window=1 (engine batches take rows in input order).
  local     the sorted arm's job on the in-process executor (runtime.executor=local: one engine, no Ray;
            parts prepared on a thread while the model loads and the previous part generates).
With --engines N > 1 the Ray arms spread over N GPUs while `engine` uses one: compare per GPU.
Each arm's line gives its wall time and two ratios to the engine arm: end to end (engine seconds / submit
seconds) and while busy (engine seconds / the run summary's engine_generate_s, the engine's time inside
its parts).

Model: --shape writes a random-weight Llama-family checkpoint (safetensors, bf16) with deepinfer's demo
tokenizer; --model uses a local checkpoint. Prompts are demo-corpus text of mixed lengths (--min-words ..
--max-words, seeded), outputs forced to --output-len tokens (ignore_eos) so every arm does the same work.
Record results in benchmarks/RESULTS.md with the command, date and GPU.

Repetitions: the engine arm warms up once then runs `--runs` times in one process; the pipeline arms run
one unmeasured warm-up submit (page cache, kernel caches on disk), then `--runs` rounds in which the
arms alternate (sorted, unsorted, sorted, ...), each into a fresh output path. Medians and min/max are
reported. `--profile-steps` adds one profiled engine run: GPU busy fraction and host ms per decode step.
`--out X` writes the summary to X and one JSON line per run to X.jsonl; each submit's stderr is kept
beside X (X-<arm>-<run>.stderr). Each pipeline run's line carries the run summary's `startup` figures
(seconds since the job's clock started: Ray up, engine actor started, model loaded, first token, first
and last commit...; `driver_process_started_s` <= 0 is the process's start, interpreter and imports
before the clock) and `exit_s`, the process's time after the clock (Ray shutdown, interpreter exit);
the summary prints their medians per arm.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import JsonOut, StepRecorder, profiled_run, spread

SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
}


def write_random_checkpoint(shape: str, root: Path) -> Path:
    """A Llama checkpoint with random bf16 weights (HF names) and the demo tokenizer."""
    import torch
    from deepinfer.engine.models.demo import demo_config, write_tokenizer_files
    from safetensors.torch import save_file

    d = root / shape
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(d)
    cfg = demo_config(SHAPES[shape]["vocab_size"], 0, 1, 4)
    cfg.update(SHAPES[shape], max_position_embeddings=8192, torch_dtype="bfloat16")
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}))
    h, inter, vocab, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*s: int):
        return (torch.randn(*s, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()

    sd = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                   p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                   p + "mlp.down_proj.weight": rand(h, inter),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _checkpoint(args: argparse.Namespace, root: Path) -> Path:
    """The random checkpoint of --shape: written under the run's temporary directory, or under
    --checkpoint-dir (kept, and reused by later runs and by bench_load.py --model)."""
    if args.checkpoint_dir is None:
        return write_random_checkpoint(args.shape, root)
    d = Path(args.checkpoint_dir) / args.shape
    if (d / "model.safetensors").is_file() and (d / "config.json").is_file():
        return d
    return write_random_checkpoint(args.shape, Path(args.checkpoint_dir))


def write_rows(path: Path, n: int, min_words: int, max_words: int, seed: int) -> None:
    from importlib import resources

    words = resources.files("deepinfer.engine.models").joinpath("data/demo_corpus.txt").read_text().split()
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            k = rng.randint(min_words, max_words)
            start = rng.randrange(0, len(words) - k)
            f.write(json.dumps({"id": i, "text": " ".join(words[start:start + k])}) + "\n")


def spec_doc(model_dir: str, data: Path, out: Path, args: argparse.Namespace, sort_window: int,
             executor: str = "ray") -> dict:
    return {
        "model": {"path": model_dir, "dtype": "bfloat16", "max_model_len": args.max_model_len},
        "input": {"path": str(data), "format": "jsonl", "id_column": "id"},
        "prompt": {"mode": "raw", "template": "{{ text }}"},
        "sampling": {"temperature": 0.0, "max_tokens": args.output_len, "ignore_eos": True},
        "output": {"path": str(out), "format": "parquet"},
        "runtime": {"executor": executor, "engines": args.engines if executor == "ray" else None,
                    "batch_size": args.batch_size, "sort_window": sort_window,
                    "rows_per_part": args.rows_per_part, "max_num_seqs": args.max_num_seqs},
    }


def run_engine_alone(model_dir: str, data: Path, args: argparse.Namespace, out: JsonOut) -> dict:
    import torch
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.text.tokenizer import Tokenizer

    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    prompts = Tokenizer.from_dir(model_dir).encode_batch(texts)
    # No prefix cache: repeated runs over the same rows would otherwise skip their prefill.
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    rec = StepRecorder(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def one() -> tuple[float, int]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        rec.end()
        return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)

    one()  # warm-up: every kernel shape of the measured runs compiled and seen once
    rec.reset()
    seconds = []
    for i in range(args.runs):
        dt, n_out = one()
        seconds.append(dt)
        out.line({"arm": "engine", "run": i, "seconds": dt, "output_tokens": n_out})
    result = {"arm": "engine", "seconds": spread(seconds), "output_tokens": n_out,
              "prompt_tokens": sum(map(len, prompts)), "steps": rec.host_summary()}
    if args.profile_steps:
        result["profile"] = profiled_run(llm, prompts, sp, rec)
    # The pipeline arms run in subprocesses that need the GPU memory this engine holds: the engine goes
    # with this frame, and main() collects it.
    return result


STARTUP_KEYS = ("driver_process_started_s", "engine_preload_started_s", "engine_preload_native_s",
                "engine_preload_cuda_s", "engine_preload_triton_s", "output_opened_s", "executor_requested_s",
                "executor_started_s", "engine_process_started_s", "engine_actor_started_s",
                "engine_imported_s", "engine_allocated_s", "engine_weights_loaded_s", "engine_kv_allocated_s",
                "model_loaded_s", "engine_ready_s",
                "first_part_received_s", "first_token_s", "first_commit_s", "last_result_s", "wall_s",
                "cuda_graph_capture_s", "engine_wait_s", "engine_generate_s", "engine_commit_s")


def run_pipeline(arm: str, model_dir: str, data: Path, root: Path, args: argparse.Namespace,
                 tag: str) -> dict:
    import yaml

    out = root / f"out-{arm}-{tag}"  # a fresh output path per run: never a resume of an earlier one
    spec = root / f"{arm}-{tag}.yaml"
    window = 1 if arm == "unsorted" else args.rows
    executor = "local" if arm == "local" else "ray"
    spec.write_text(yaml.safe_dump(spec_doc(model_dir, data, out, args, window, executor)))
    summary_path = root / f"{arm}-{tag}-summary.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", "submit", str(spec),
                           "--summary-json", str(summary_path)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    stderr_path = None
    if args.out:
        stderr_path = Path(f"{args.out}-{arm}-{tag}.stderr")
        stderr_path.parent.mkdir(parents=True, exist_ok=True)
        stderr_path.write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: deepinfer-job exited {proc.returncode}\n{proc.stderr[-4000:]}")
    s = json.loads(summary_path.read_text())
    startup = s.get("startup") or {}
    # After the job's clock (Ray shutdown, exit): the time before it is driver_process_started_s.
    exit_s = seconds - s["wall_seconds"] + (startup.get("driver_process_started_s") or 0.0)
    return {"arm": arm, "seconds": seconds, "job_wall_seconds": s["wall_seconds"],
            "output_tokens": s["tokens"]["output"], "prompt_tokens": s["tokens"]["prompt"],
            "output_tokens_per_s": s["tokens"]["output"] / seconds, "engines": s["engines"],
            "time_to_first_token_s": s.get("time_to_first_token_s"), "startup": startup,
            "executor": s.get("executor"), "exit_s": exit_s,
            "stderr": str(stderr_path) if stderr_path else None}


def startup_medians(runs: list[dict]) -> dict:
    """The median of each startup figure over `runs` (the keys every run has), plus exit_s."""
    import statistics

    out = {}
    for key in STARTUP_KEYS:
        values = [r["startup"][key] for r in runs if r["startup"].get(key) is not None]
        if len(values) == len(runs):
            out[key] = statistics.median(values)
    out["exit_s"] = statistics.median(r["exit_s"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    group.add_argument("--model", help="local checkpoint directory instead of a random-weight shape")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--min-words", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=768)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256, help="runtime.batch_size (rows per engine call)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rows-per-part", type=int, default=512)
    ap.add_argument("--engines", type=int, default=None, help="engine actors (default: one per GPU)")
    ap.add_argument("--arms", default="engine,sorted,unsorted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3, help="measured runs per arm, after one warm-up")
    ap.add_argument("--no-pipeline-warmup", action="store_true", help="skip the unmeasured first submit")
    ap.add_argument("--profile-steps", action="store_true",
                    help="one more profiled engine run: GPU busy fraction and host ms per decode step")
    ap.add_argument("--out", help="summary JSON here, one line per run in OUT.jsonl")
    ap.add_argument("--checkpoint-dir", help="write (or reuse) the --shape checkpoint under this directory")
    args = ap.parse_args()

    out = JsonOut(args.out)
    arms = args.arms.split(",")
    pipeline_arms = [a for a in arms if a != "engine"]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        root = Path(tmp)
        model_dir = args.model or str(_checkpoint(args, root))
        data = root / "rows.jsonl"
        write_rows(data, args.rows, args.min_words, args.max_words, args.seed)
        results: dict[str, dict] = {}
        if "engine" in arms:
            results["engine"] = run_engine_alone(model_dir, data, args, out)
            gc.collect()
            import torch

            torch.cuda.empty_cache()
        if pipeline_arms and not args.no_pipeline_warmup:
            run_pipeline(pipeline_arms[0], model_dir, data, root, args, "warmup")
        per_arm: dict[str, list[dict]] = {a: [] for a in pipeline_arms}
        for i in range(args.runs):
            for arm in pipeline_arms:  # alternate arms so drift on the machine falls on all alike
                r = run_pipeline(arm, model_dir, data, root, args, f"run{i}")
                per_arm[arm].append(r)
                out.line({"run": i, **r})
        for arm, rs in per_arm.items():
            results[arm] = {"arm": arm, "seconds": spread([r["seconds"] for r in rs]),
                            "job_wall_seconds": spread([r["job_wall_seconds"] for r in rs]),
                            "output_tokens": rs[0]["output_tokens"], "prompt_tokens": rs[0]["prompt_tokens"],
                            "engines": rs[0]["engines"], "startup": startup_medians(rs),
                            "executor": rs[0]["executor"]}
    for r in results.values():
        r["output_tokens_per_s"] = spread([r["output_tokens"] / s for s in r["seconds"]["runs"]])
        print(f"{r['arm']:9s} median {r['seconds']['median']:8.1f} s (min {r['seconds']['min']:.1f}, max "
              f"{r['seconds']['max']:.1f})  {r['output_tokens']:9d} out tokens  "
              f"{r['output_tokens_per_s']['median']:10.0f} out tok/s", flush=True)
    for r in results.values():
        if "startup" in r:
            print(f"{r['arm']:9s} startup medians (s since the job's clock started): "
                  + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in r["startup"].items()), flush=True)
    base = results.get("engine")
    if base is not None:
        for r in results.values():
            r["vs_engine"] = r["output_tokens_per_s"]["median"] / base["output_tokens_per_s"]["median"]
            line = (f"{r['arm']:9s} wall {r['seconds']['median']:.1f} s, {r['vs_engine']:.2f}x the engine "
                    "alone end to end (medians)")
            busy = (r.get("startup") or {}).get("engine_generate_s")
            if busy:
                r["vs_engine_busy"] = base["seconds"]["median"] / busy
                line += f", {r['vs_engine_busy']:.2f}x while its engine is busy ({busy:.1f} s)"
            if r.get("executor"):
                line += f"; executor {r['executor']['name']} ({r['executor']['reason']})"
            print(line, flush=True)
    out.summary({"bench": "pipeline", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
