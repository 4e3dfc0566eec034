"""Several GPUs on one host: data-parallel engines, tensor parallel, expert parallel (issue 17).

Run on a machine with 2 GPUs (NCCL; this script sets NCCL_NVLS_ENABLE=0, NVLink multicast off):
    python benchmarks/bench_parallel.py --out parallel.json                # every arm, about 25-35 minutes
    python benchmarks/bench_parallel.py --arms dp --rows 4096 --out dp.json
CPU smoke run (gloo, tiny shapes; proves the script end to end in a minute or two):
    python benchmarks/bench_parallel.py --quick

Arms:
  dp  `deepinfer-job submit` on the Llama-3.1-8B shape (a random bf16 checkpoint written once, demo
      tokenizer), runtime.engines 1 then 2 on the Ray executor, the same rows and sampling; out tok/s from
      each run's summary (whole run, and steady: after the first token) and the speedup of 2 engines over 1
      (acceptance: >= 1.9x), plus whether the two outputs are byte-identical (sha256 of every part).
  tp  LLM(tensor_parallel_size=2) on a Llama-3.1-70B-class shape (about 141 GB of bf16 weights: more than
      one H200 holds), random weights (load_format="dummy"): out tok/s over --tp-prompts random prompts,
      and whether the same requests in another batch order give identical tokens (deterministic mode).
  ep  the DeepSeek-V2-Lite MoE layer (64 routed experts top-6, 2 shared, hidden 2048, expert width 1408)
      with its experts split 32 + 32 over 2 GPUs (ExpertParallelMoE: all-gather dispatch, all-to-all
      combine), --ep-tokens tokens per GPU, beside the single-device DeepseekMoE on one GPU over the same
      2 x tokens: tokens/s of one layer forward; and a bitwise check of EP against the single-device layer.
Each measured figure is the median of --runs runs after a warm-up. Record results in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import JsonOut, spread, sync

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
             "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "attention_bias": False, "mlp_bias": False}
TINY_LLAMA = dict(LLAMA_70B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, torch_dtype="float32")
V2_LITE_MOE = dict(hidden=2048, experts=64, top_k=6, shared=2, width=1408)
TINY_MOE = dict(hidden=64, experts=8, top_k=2, shared=1, width=32)


def write_config_dir(cfg: dict, root: Path, name: str) -> Path:
    """config.json + the demo tokenizer: weights come from load_format="dummy"."""
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer_files(d)
    return d


def digest(out: Path) -> str:
    """sha256 over every committed part file, in name order."""
    h = hashlib.sha256()
    for f in sorted((out / "parts").glob("*")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ---- dp: 1 vs 2 engines through deepinfer-job submit ------------------------------------------------
def submit(model: dict, data: Path, out: Path, engines: int, args: argparse.Namespace) -> dict:
    import yaml

    spec = {"model": {**model, "max_model_len": args.max_model_len},
            "input": {"path": str(data), "format": "jsonl", "id_column": "id"},
            "prompt": {"mode": "raw", "template": "{{ text }}"},
            "sampling": {"temperature": 0.8, "max_tokens": args.output_len, "ignore_eos": True, "seed": 5},
            "output": {"path": str(out), "format": "parquet"},
            "runtime": {"executor": "ray", "engines": engines, "batch_size": args.batch_size,
                        "rows_per_part": args.rows_per_part, "max_num_seqs": args.max_num_seqs}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    summary_path = out.with_suffix(".summary.json")
    attempts = 0
    while attempts < 3:
        attempts += 1
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", "submit", str(path),
                               "--summary-json", str(summary_path)], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 75:   # 75: transient (a lost Ray worker): measure a fresh run again
            break
        shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"dp: submit with {engines} engine(s) exited {proc.returncode}\n"
                         f"{proc.stderr[-4000:]}")
    s = json.loads(summary_path.read_text())
    n_out, wall = s["tokens"]["output"], s["wall_seconds"]
    steady = wall - (s.get("time_to_first_token_s") or 0.0)
    return {"engines": engines, "attempts": attempts, "seconds": seconds, "job_wall_seconds": wall,
            "output_tokens": n_out,
            "out_tok_s": n_out / wall, "steady_out_tok_s": n_out / steady if steady > 0 else None,
            "digest": digest(out)}


def arm_dp(root: Path, args: argparse.Namespace, out: JsonOut) -> dict:
    from bench_pipeline import write_random_checkpoint, write_rows

    ckpt = root / "llama-3.1-8b"
    if not args.quick and not (ckpt / "model.safetensors").is_file():   # --workdir keeps it between runs
        write_random_checkpoint("llama-3.1-8b", root)
    model = {"name": "demo"} if args.quick else {"path": str(ckpt), "dtype": "bfloat16"}
    data = root / "rows.jsonl"
    write_rows(data, args.rows, *((4, 40) if args.quick else (16, 256)), seed=0)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for i in range(args.runs):
        for engines in (1, 2):   # alternate, so drift on the machine hits both arms alike
            dest = root / f"dp-{engines}-{i}"
            shutil.rmtree(dest, ignore_errors=True)   # a fresh output each run, never a resume
            r = submit(model, data, dest, engines, args)
            out.line({"arm": "dp", "run": i, **r})
            runs[engines].append(r)
    med = {e: spread([r["out_tok_s"] for r in rs])["median"] for e, rs in runs.items()}
    steady = {e: spread([r["steady_out_tok_s"] or 0.0 for r in rs])["median"] for e, rs in runs.items()}
    digests = {r["digest"] for rs in runs.values() for r in rs}
    return {"arm": "dp", "rows": args.rows, "output_len": args.output_len,
            "out_tok_s": {e: spread([r["out_tok_s"] for r in rs]) for e, rs in runs.items()},
            "speedup_2_over_1": med[2] / med[1], "steady_speedup_2_over_1": steady[2] / steady[1],
            "byte_identical": len(digests) == 1}


# ---- tp: a 70B-class shape over 2 GPUs ---------------------------------------------------------------
def arm_tp(root: Path, args: argparse.Namespace, out: JsonOut) -> dict:
    from deepinfer.engine import LLM, SamplingParams

    cfg = TINY_LLAMA if args.quick else LLAMA_70B
    d = write_config_dir(cfg, root, "llama-tp")
    t0 = time.perf_counter()
    llm = LLM(str(d), dtype="float32" if args.quick else "bfloat16", device=args.device,
              load_format="dummy", tensor_parallel_size=2, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs)
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg["vocab_size"]) for _ in range(rng.randint(64, args.prompt_len))]
               for _ in range(args.tp_prompts)]
    sp = SamplingParams(temperature=0.8, max_tokens=args.output_len, ignore_eos=True, seed=3)

    def one(batch: list[list[int]]) -> tuple[float, list]:
        sync()
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        sync()
        return time.perf_counter() - t, outs

    one(prompts[: max(1, len(prompts) // 8)])   # warm-up
    secs, first = [], None
    for i in range(args.runs):
        dt, outs = one(prompts)
        first = first or outs
        n = sum(len(o.token_ids) for o in outs)
        secs.append(dt)
        out.line({"arm": "tp", "run": i, "seconds": dt, "output_tokens": n, "out_tok_s": n / dt})
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    _, shuffled = one([prompts[i] for i in order])
    same = all(shuffled[j].token_ids == first[i].token_ids for j, i in enumerate(order))
    n_out = sum(len(o.token_ids) for o in first)
    llm.model.shutdown()
    llm = first = shuffled = None
    gc.collect()   # rank 0's shard leaves GPU 0 before the next arm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    h, q, kv = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"], (
        cfg["num_key_value_heads"] * cfg["head_dim"])
    params = (cfg["num_hidden_layers"] * (h * (2 * q + 2 * kv) + 3 * h * cfg["intermediate_size"])
              + 2 * cfg["vocab_size"] * h)
    return {"arm": "tp", "tensor_parallel_size": 2, "shape": "tiny" if args.quick else "llama-70b-class",
            "approx_params": params, "start_seconds": start_s, "prompts": len(prompts),
            "seconds": spread(secs), "out_tok_s": n_out / spread(secs)["median"],
            "identical_across_batch_order": same}


# ---- ep: the V2-Lite MoE layer, experts over 2 GPUs --------------------------------------------------
def moe_layer(shape: dict, device: torch.device, dtype: torch.dtype):
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.layers.moe import DeepseekMoE
    from deepinfer.engine.models.deepseek_config import MoEConfig

    cfg = MoEConfig(n_routed_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                    n_shared_experts=shape["shared"], moe_intermediate_size=shape["width"],
                    topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0,
                    norm_topk_prob=False, first_k_dense_replace=0)
    layer = DeepseekMoE(cfg, shape["hidden"], False, make_ops(device, True), dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.05)
    return layer


def ep_tokens(shape: dict, n: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((n, shape["hidden"]), generator=gen, device=device).to(dtype)


def time_forward(fn, x: torch.Tensor, runs: int) -> list[float]:
    fn(x)
    secs = []
    for _ in range(runs):
        sync()
        t = time.perf_counter()
        fn(x)
        sync()
        secs.append(time.perf_counter() - t)
    return secs


def _ep_rank(rank: int, store_path: str, result_path: str, quick: bool, tokens: int, runs: int) -> None:
    import torch.distributed as dist
    from deepinfer.engine.parallel.comm import ParallelGroup
    from deepinfer.engine.parallel.expert_parallel import ExpertParallelMoE

    device = torch.device("cpu") if quick else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if quick else torch.bfloat16
    shape = TINY_MOE if quick else V2_LITE_MOE
    group = ParallelGroup(dist.FileStore(store_path, 2), rank, 2, device, deterministic=True)
    ep = ExpertParallelMoE.from_layer(moe_layer(shape, device, dtype), group)
    with torch.inference_mode():
        check = ep_tokens(shape, 64, 7, device, dtype)
        mine = ep(check[rank * 32:(rank + 1) * 32]).cpu()
        x = ep_tokens(shape, tokens, 100 + rank, device, dtype)
        secs = time_forward(ep, x, runs)
    torch.save({"check": mine, "seconds": secs}, f"{result_path}.{rank}")


def arm_ep(root: Path, args: argparse.Namespace, out: JsonOut) -> dict:
    import torch.multiprocessing as mp

    quick = args.quick
    tokens = 64 if quick else args.ep_tokens
    mp.start_processes(_ep_rank, args=(str(root / "ep-store"), str(root / "ep"), quick, tokens, args.runs),
                       nprocs=2, start_method="spawn")
    ranks = [torch.load(root / f"ep.{r}") for r in range(2)]
    device = torch.device("cpu") if quick else torch.device("cuda", 0)
    dtype = torch.float32 if quick else torch.bfloat16
    shape = TINY_MOE if quick else V2_LITE_MOE
    layer = moe_layer(shape, device, dtype)
    with torch.inference_mode():
        expected = layer(ep_tokens(shape, 64, 7, device, dtype)).cpu()
        single = time_forward(layer, ep_tokens(shape, 2 * tokens, 100, device, dtype), args.runs)
    bitwise = torch.equal(torch.cat([r["check"] for r in ranks]), expected)
    ep_s = spread([max(a, b) for a, b in zip(ranks[0]["seconds"], ranks[1]["seconds"])])
    one_s = spread(single)
    r = {"arm": "ep", "expert_parallel_size": 2, "shape": "tiny" if quick else "deepseek-v2-lite-moe",
         "tokens_per_gpu": tokens, "ep_seconds": ep_s, "single_gpu_seconds": one_s,
         "ep_tok_s": 2 * tokens / ep_s["median"], "single_gpu_tok_s": 2 * tokens / one_s["median"],
         "bitwise_equal_to_single_device": bitwise}
    out.line(r)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="dp,tp,ep")
    ap.add_argument("--quick", action="store_true", help="CPU + gloo, tiny shapes (a smoke run)")
    ap.add_argument("--rows", type=int, default=4096, help="dp: rows of the job")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512, help="tp: longest random prompt")
    ap.add_argument("--tp-prompts", type=int, default=256)
    ap.add_argument("--ep-tokens", type=int, default=4096, help="ep: tokens per GPU per forward")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=512, help="dp: runtime.batch_size")
    ap.add_argument("--rows-per-part", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", help="keep the dp arm's 8B checkpoint here (reused when present) instead "
                    "of a temporary directory")
    ap.add_argument("--out", help="summary JSON here, one line per run in OUT.jsonl")
    args = ap.parse_args()
    args.device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.rows, args.output_len, args.prompt_len, args.tp_prompts = 12, 8, 80, 6
        args.max_model_len, args.max_num_seqs, args.batch_size, args.rows_per_part = 256, 16, 4, 6
        args.runs = min(args.runs, 2)
    elif torch.cuda.device_count() < 2:
        raise SystemExit("bench_parallel needs 2 GPUs (or --quick on CPU)")
    out = JsonOut(args.out)
    arms = {"dp": arm_dp, "tp": arm_tp, "ep": arm_ep}
    report: dict = {"quick": args.quick, "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        for name in args.arms.split(","):
            if name not in arms:
                raise SystemExit(f"--arms: unknown arm {name!r}; choose from {sorted(arms)}")
            root = Path(args.workdir) if args.workdir and name == "dp" else Path(tmp) / name
            root.mkdir(parents=True, exist_ok=True)
            report[name] = arms[name](root, args, out)
    out.summary(report)


if __name__ == "__main__":
    main()
