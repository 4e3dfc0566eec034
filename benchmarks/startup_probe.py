"""Where a `deepinfer-job submit` on the in-process executor spends its fixed (non-engine) seconds.

    python benchmarks/startup_probe.py imports --reps 2      # the CLI's imports: in order vs overlapped
    python benchmarks/startup_probe.py engine --shape llama-3.1-8b --rows 256 --output-len 16
    python benchmarks/startup_probe.py preload --reps 4       # engine import + CUDA, three preload orders

`imports`: in fresh interpreters, the submit path's driver imports (runner, spec loading: pyarrow, fsspec,
yaml) and the engine's (`deepinfer.engine.llm`: torch) one after the other, then with the engine's
imports started on a thread first (what cli.main does for `submit`): wall seconds of each, alternating.

`preload`: in fresh interpreters, the CLI's path from the driver's extension imports to an imported engine
and a CUDA context: plain, with executors/engine_preload.py's EnginePreload (libraries and CUDA) started
after the driver's extensions as the CLI does when asked, and with the engine's modules also imported on
a thread before the driver's imports; alternating, with each mode's median.

`engine`: one fresh interpreter builds the --shape engine with random (dummy) weights, captures graphs
lazily (as the pipeline's engines do) and generates twice over the same prompts; the first generate's
extra seconds over the second are first-use costs (kernel binaries loaded, planner proofs, lazy capture).
Prints the construction phases, each generate's wall, its first steps' host seconds and the capture
seconds. Needs CUDA for the 8B shape (its dummy weights are 16 GB); `--shape tiny` runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRIVER_IMPORTS = ("import deepinfer.pipeline.runner, deepinfer.pipeline.spec.load, "
                  "deepinfer.pipeline.executors.local, deepinfer.pipeline.stages.plan")
ENGINE_IMPORTS = "import deepinfer.engine.llm"

_SEQUENTIAL = f"""
import time; t0 = time.perf_counter()
{DRIVER_IMPORTS}
t1 = time.perf_counter()
{ENGINE_IMPORTS}
t2 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{t2 - t0:.3f}}")
"""

_OVERLAPPED = f"""
import threading, time; t0 = time.perf_counter()
done = {{}}
def eng():
    {ENGINE_IMPORTS}
    done["engine"] = time.perf_counter()
th = threading.Thread(target=eng); th.start()
{DRIVER_IMPORTS}
t1 = time.perf_counter()
th.join()
t2 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{done['engine'] - t0:.3f}} {{t2 - t0:.3f}}")
"""


_PRELOAD = """
import os, sys, threading, time; t0 = time.perf_counter()
from deepinfer.pipeline.executors import engine_preload as ep
mode = sys.argv[1]
preload = None
if mode == "preload-import":   # the variant measured slower (RESULTS.md): engine modules on a thread first
    preload = ep.EnginePreload(0)
    importer = threading.Thread(target=lambda: __import__("deepinfer.engine.llm"), daemon=True)
    importer.start()
ep.load_driver_extensions()
if mode == "preload-native":   # the CLI's order (opt-in): extensions, then libraries + CUDA on a thread
    preload = ep.EnginePreload(0)
t1 = time.perf_counter()
import deepinfer.pipeline.runner, deepinfer.pipeline.executors.local  # the driver's remaining imports
t2 = time.perf_counter()
import deepinfer.engine.llm, torch
t3 = time.perf_counter()
if preload is not None:
    preload.engine_imported()
if torch.cuda.is_available():
    torch.empty(1, device="cuda")
t4 = time.perf_counter()
if preload is not None:
    preload.join()
t5 = time.perf_counter()
print(f"{mode:14s}: extensions {t1 - t0:.2f}, driver imports {t2 - t1:.2f}, engine import {t3 - t2:.2f}, "
      f"cuda {t4 - t3:.2f}, to cuda ready {t4 - t0:.2f} s, preload joined {t5 - t0:.2f} s", flush=True)
"""

PRELOAD_MODES = ("plain", "preload-native", "preload-import")


def probe_preload(reps: int) -> None:
    """The CLI's path to an imported engine and a CUDA context: no preload, the CLI's opt-in preload
    (libraries and CUDA on a thread after the driver's extensions), and that preload plus the engine's
    modules imported on a thread before the driver's own imports; alternating, then each mode's median
    time to a ready CUDA context."""
    ready: dict[str, list[float]] = {m: [] for m in PRELOAD_MODES}
    for _ in range(reps):
        for mode in PRELOAD_MODES:
            out = subprocess.run([sys.executable, "-c", _PRELOAD, mode], capture_output=True, text=True)
            line = out.stdout.strip()
            print(line or out.stderr[-800:], flush=True)
            if "to cuda ready" in line:
                ready[mode].append(float(line.split("to cuda ready ")[1].split(" s")[0]))
    medians = [f"{m} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for m, v in ready.items() if v]
    print("median s to a ready CUDA context: " + ", ".join(medians), flush=True)


def probe_imports(reps: int) -> None:
    rows: dict[str, list[str]] = {"sequential": [], "overlapped": []}
    for _ in range(reps):
        for name, code in (("sequential", _SEQUENTIAL), ("overlapped", _OVERLAPPED)):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            rows[name].append(out.stdout.strip())
    print("imports sequential (driver s, engine s, total s):", rows["sequential"], flush=True)
    print("imports overlapped (driver done s, engine done s, total s):", rows["overlapped"], flush=True)


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 576}


def write_config_dir(shape: str, root: Path) -> Path:
    """config.json and the demo tokenizer of `shape`, no weights (the engine runs load_format=dummy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_pipeline import SHAPES
    from deepinfer.engine.models.demo import demo_config, write_tokenizer_files

    dims = TINY if shape == "tiny" else SHAPES[shape]
    d = root / shape
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(d)
    cfg = demo_config(dims["vocab_size"], 0, 1, 4)
    cfg.update(dims, max_position_embeddings=8192, torch_dtype="bfloat16")
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}))
    return d


def _time_phases() -> dict[str, float]:
    """Wrap LLM construction's phases (names in deepinfer.engine.llm) to time them; returns the dict the
    wrappers fill: phase -> seconds (CUDA-synchronized)."""
    import deepinfer.engine.llm as m
    import torch

    out: dict[str, float] = {}
    names = ("build_model", "init_dummy_with_plan", "load_with_plan", "blocks_that_fit",
             "allocate_kv_cache_for", "make_decode_graphs", "make_ops")

    def wrap(name: str, fn):
        def timed(*a, **k):
            s = time.perf_counter()
            r = fn(*a, **k)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            out[name] = round(out.get(name, 0.0) + time.perf_counter() - s, 3)
            return r
        return timed

    for name in names:
        if hasattr(m, name):
            setattr(m, name, wrap(name, getattr(m, name)))
    return out


# A pure-Python loop, timed alone and beside CUDA context creation (does the latter hold the GIL?).
_BUSY = """
import time, threading, torch
def busy(n):
    x = 0
    for i in range(n):
        x += i
n = 3_000_000
"""

_CUDA_INIT = _BUSY + """
s = time.perf_counter(); busy(n); solo = time.perf_counter() - s
s = time.perf_counter(); torch.cuda.init(); torch.empty(1, device="cuda"); init = time.perf_counter() - s
print(f"python loop alone {solo:.3f} s, cuda init alone {init:.3f} s", flush=True)
"""

_CUDA_INIT_OVERLAP = _BUSY + """
done = {}
def init():
    s = time.perf_counter(); torch.cuda.init(); torch.empty(1, device="cuda")
    done["init"] = time.perf_counter() - s
th = threading.Thread(target=init); s = time.perf_counter(); th.start()
busy(n); loop = time.perf_counter() - s; th.join(); total = time.perf_counter() - s
print(f"overlapped: python loop {loop:.3f} s, cuda init {done['init']:.3f} s, both {total:.3f} s", flush=True)
"""


def probe_cuda_init() -> None:
    """Does CUDA context creation release the GIL (can it overlap the driver's Python)?"""
    for code in (_CUDA_INIT, _CUDA_INIT_OVERLAP):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-500:], flush=True)


def probe_engine(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import torch
    t_torch = time.perf_counter()
    from deepinfer.engine import LLM, SamplingParams
    t_import = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="startup-probe-") as tmp:
        model_dir = write_config_dir(args.shape, Path(tmp))
        t_cfg = time.perf_counter()
        phases = _time_phases()
        llm = LLM(model=str(model_dir), dtype="bfloat16", load_format="dummy", max_model_len=4096,
                  max_num_seqs=256, enable_prefix_caching=False, cuda_graph_capture="lazy")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t_built = time.perf_counter()
        print(f"engine probe: import torch {t_torch - t0:.2f} s, engine modules {t_import - t_torch:.2f} s, "
              f"LLM() {t_built - t_cfg:.2f} s: {phases}", flush=True)
        corpus = Path(__file__).resolve().parents[1] / "engine/models/data/demo_corpus.txt"
        words = corpus.read_text().split()
        texts = [" ".join(words[i * 7: i * 7 + 40 + (i * 37) % 160]) for i in range(args.rows)]
        prompts = llm.tokenizer.encode_batch(texts)
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        core = llm.engine
        for rep in range(2):
            marks: list[float] = []
            schedule = core.scheduler.schedule

            def timed(*a, _schedule=schedule, _marks=marks, **k):
                _marks.append(time.perf_counter())
                return _schedule(*a, **k)

            core.scheduler.schedule = timed
            s = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - s
            core.scheduler.schedule = schedule
            steps = [b - a for a, b in zip([s, *marks], [*marks, time.perf_counter()])]
            stats = core.stats() if hasattr(core, "stats") else {}
            print(f"generate {rep}: {wall:.2f} s, {len(steps)} steps, first steps "
                  f"{[round(x, 3) for x in steps[:6]]}, top {sorted(round(x, 3) for x in steps)[-4:]}, "
                  f"capture {stats.get('cuda_graph_capture_s')}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("imports", "engine", "cudainit", "preload"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    if args.what == "imports":
        probe_imports(args.reps)
    elif args.what == "cudainit":
        probe_cuda_init()
    elif args.what == "preload":
        probe_preload(args.reps)
    else:
        probe_engine(args)


if __name__ == "__main__":
    main()
