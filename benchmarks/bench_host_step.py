"""Host time of one decode step of the overlapped loop, split by phase, on CPU with a near-free model.

The 0.5B shape on the H200 is host-bound: the device finishes a decode step long before the host has
scheduled, staged and post-processed the next. This benchmark runs the real engine (LLM: Scheduler,
BlockManager, finish rules, OutputProcessor with a real byte-level BPE tokenizer, StepExecutor, the
overlapped loop of core/overlap.py) over the smallest real model the registry builds (Qwen2 architecture,
1 layer, hidden 16) on CPU, so nearly all of a step is host work, and times each phase of each step:

    schedule       Scheduler.schedule
    commit_launch  Scheduler.commit_launch
    input_prep     StepExecutor.forward minus the model itself (placeholder lookup + graph staging, or
                   ModelRunner.prepare without graphs)
    sample_launch  StepExecutor.sample minus logits and the sampler (metadata, row selection)
    update         Scheduler.update (placeholders resolved, stop checks, detokenization, block accounting)
    loop           the rest of the loop iteration (reading the ids, PENDING_TOKEN appends, stats)
    host           the sum of the above; `model` (forward + logits) and `sampler` are reported apart since
                   on the GPU they are device work.

Pure-decode steps run through DecodeGraphs' CPU stand-in replays (the graph path's staging, an eager
forward in place of the replay) unless --no-graphs. Medians over the decode steps of a run, then the median
of those over --runs runs. Single-threaded torch, since the machine is shared.

    python3 benchmarks/bench_host_step.py --runs 3
    python3 benchmarks/bench_host_step.py --runs 1 --profile     # cProfile top 25 of the decode steps
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PHASES = ("schedule", "commit_launch", "input_prep", "sample_launch", "update", "loop")
TINY_QWEN = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": True, "torch_dtype": "float32", "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 1,
}


def model_dir(root: Path, vocab: int) -> Path:
    """A tiny Qwen2 config beside a `vocab`-entry byte-level BPE trained on the shipped corpus."""
    from bigtok import build_tokenizer_dir
    from deepinfer.engine.models.demo import BOS_TOKEN, EOS_TOKEN

    tok_dir = build_tokenizer_dir(vocab)
    d = root / f"tiny-qwen-{vocab}"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tok_dir / name).read_bytes())
    vocab_map = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos = vocab_map[BOS_TOKEN], vocab_map[EOS_TOKEN]
    cfg = dict(TINY_QWEN, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return d


class PhaseTimer:
    """Wraps engine methods (instance attributes, so nothing else is touched) to time each loop phase.

    A step's window runs from one `schedule()` call to the next; nested device work (model, sampler) is
    subtracted from the phase that contains it."""

    def __init__(self, llm: Any, graphs: bool, profiler: cProfile.Profile | None) -> None:
        self.steps: list[dict[str, int]] = []
        self._cur: dict[str, int] | None = None
        self._start = 0
        self._decode = False
        self._profiler = profiler
        self._profiling = False
        core = llm.engine
        sched, ex, runner = core.scheduler, core.executor, core.runner
        if graphs:
            from deepinfer.engine.runner.cuda_graphs import DecodeGraphs

            g = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size,
                             llm.sched_cfg.max_model_len, llm.sched_cfg.max_num_seqs, runner.device)
            g.stand_in_replays()
            ex.graphs = g
        self._wrap_schedule(sched)
        self._wrap(sched, "commit_launch", "commit_launch")
        self._wrap(ex, "forward", "input_prep")
        self._wrap(ex, "sample", "sample_launch")
        self._wrap(sched, "update", "update")
        # Instance attributes of the model: its forward (eager, or a stand-in graph's replay), its logits.
        self._wrap(runner.model, "forward", "model", device=True)
        self._wrap(runner.model, "compute_logits", "model", device=True)
        if hasattr(runner.model, "compute_logits_native"):   # what StepExecutor.sample calls where present
            self._wrap(runner.model, "compute_logits_native", "model", device=True)
        self._wrap(runner, "sampler", "sampler", device=True)

    def close(self) -> None:
        self._end_step()

    def _timed(self, phase: str, device: bool, fn: Any, a: tuple, k: dict) -> Any:
        pause = self._profiling and device   # the profile is of host work only
        if pause:
            self._profiler.disable()
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter_ns() - t0
            if pause:
                self._profiler.enable()
            if self._cur is not None:
                self._cur[phase] = self._cur.get(phase, 0) + dt
                if device:   # the enclosing phase (input_prep / sample_launch) loses this time
                    self._cur["_nested"] = self._cur.get("_nested", 0) + dt

    def _wrap(self, obj: Any, name: str, phase: str, device: bool = False) -> None:
        inner = getattr(obj, name)
        timer = self

        if device:
            def wrapped(*a: Any, **k: Any) -> Any:
                return timer._timed(phase, True, inner, a, k)
        else:
            def wrapped(*a: Any, **k: Any) -> Any:
                if timer._cur is None:
                    return inner(*a, **k)
                nested0 = timer._cur.get("_nested", 0)
                t0 = time.perf_counter_ns()
                try:
                    return inner(*a, **k)
                finally:
                    dt = time.perf_counter_ns() - t0 - (timer._cur.get("_nested", 0) - nested0)
                    timer._cur[phase] = timer._cur.get(phase, 0) + dt
        setattr(obj, name, wrapped)

    def _wrap_schedule(self, sched: Any) -> None:
        from deepinfer.engine.runner.cuda_graphs import is_decode_step

        inner = sched.schedule
        timer = self

        def schedule() -> Any:
            timer._end_step()
            t0 = time.perf_counter_ns()
            out = inner()
            dt = time.perf_counter_ns() - t0
            timer._decode = is_decode_step(out)   # reads a decode batch without building its rows
            timer._cur = {"schedule": dt, "rows": out.num_rows}
            timer._start = t0
            if timer._profiler is not None and timer._decode != timer._profiling:
                (timer._profiler.enable if timer._decode else timer._profiler.disable)()
                timer._profiling = timer._decode
            return out

        sched.schedule = schedule

    def _end_step(self) -> None:
        cur = self._cur
        if cur is None:
            return
        total = time.perf_counter_ns() - self._start
        cur["loop"] = total - sum(v for k, v in cur.items() if k in PHASES or k in ("model", "sampler"))
        cur["decode"] = int(self._decode)
        self.steps.append(cur)
        self._cur = None
        if self._profiling:
            self._profiler.disable()
            self._profiling = False


def one_run(llm: Any, prompts: list[list[int]], params: list[Any], graphs: bool,
            profiler: cProfile.Profile | None) -> dict[str, Any]:
    timer = PhaseTimer(llm, graphs, profiler)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        timer.close()   # each run builds a fresh engine, so wrappers never stack
    wall = time.perf_counter() - t0
    full = [s for s in timer.steps if s["decode"] and s["rows"] == len(prompts)]
    med = {p: statistics.median(s.get(p, 0) for s in full) / 1000 for p in (*PHASES, "model", "sampler")}
    med["host"] = sum(med[p] for p in PHASES)
    return {"wall_s": wall, "decode_steps_full_batch": len(full), "steps": len(timer.steps),
            "us_per_step_median": med, "outputs": [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload of the CPU host benchmarks (this one, gc_pauses.py)."""
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=4096)


def workload(args: argparse.Namespace) -> tuple[Path, list[list[int]]]:
    """(the tiny model's directory, the random prompts) of `add_workload_args`' arguments."""
    d = model_dir(Path(tempfile.gettempdir()) / "deepinfer-bench", args.vocab)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, args.vocab - 100, (args.num_prompts, args.prompt_len), generator=g).tolist()
    return d, prompts


def tiny_llm(d: Path, args: argparse.Namespace, **kw: Any) -> Any:
    """An LLM over the tiny model on CPU, sized for the workload (every request's blocks fit)."""
    from deepinfer.engine import LLM

    return LLM(model=str(d), dtype="float32", device="cpu", load_format="dummy",
               max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.num_prompts,
               max_num_batched_tokens=16384,
               num_kv_blocks=args.num_prompts * ((args.prompt_len + args.output_len) // 16 + 2), **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stop-frac", type=float, default=0.0,
                    help="share of requests given a (never matching) stop string: incremental detokenization")
    ap.add_argument("--no-graphs", action="store_true", help="eager ModelRunner.prepare for decode steps")
    ap.add_argument("--sync", action="store_true", help="the synchronous loop instead of the overlapped one")
    ap.add_argument("--penalties", choices=("all", "pf"),
                    help="every request with penalties: all = repetition 1.1, presence and frequency 0.2; "
                         "pf = presence and frequency 0.2 only")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps; print the top 25")
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from deepinfer.engine import SamplingParams

    d, prompts = workload(args)
    n_stop = int(round(args.stop_frac * args.num_prompts))
    # One params object for the plain requests, as bench_throughput.py passes (the engine reads it once).
    pen = {"presence_penalty": 0.2, "frequency_penalty": 0.2} if args.penalties else {}
    if args.penalties == "all":
        pen["repetition_penalty"] = 1.1
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, **pen)
    stop = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                          stop=["\x00never\x00"], **pen)
    params = [stop if i < n_stop else plain for i in range(args.num_prompts)]
    runs, first = [], None
    prof = cProfile.Profile() if args.profile else None
    for i in range(args.runs + 1):   # run 0 warms up
        llm = tiny_llm(d, args, async_scheduling=not args.sync)
        r = one_run(llm, prompts, params, not args.no_graphs, prof if i == args.runs else None)
        outs = r.pop("outputs")
        first = first or outs
        r["same_outputs_as_warmup"] = outs == first
        if i:
            runs.append(r)
            print(json.dumps({"run": i, **r}), flush=True)
    keys = runs[0]["us_per_step_median"]
    med = {p: statistics.median(r["us_per_step_median"][p] for r in runs) for p in keys}
    # Digest of every request's tokens and text: equal across engine versions when outputs are unchanged.
    digest = hashlib.sha256(json.dumps(first).encode()).hexdigest()[:16]
    summary = {"config": vars(args), "host_us_per_decode_step": {k: round(v, 1) for k, v in med.items()},
               "runs": [r["us_per_step_median"]["host"] for r in runs], "outputs_sha256": digest}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
