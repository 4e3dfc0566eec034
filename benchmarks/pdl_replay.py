"""Device time of one decode step with and without programmatic dependent launch (kernels/pdl.py).

The engine's own captured decode graph (bucket `--batch`, deterministic mode) is replayed back to back with
no host work between replays, so the figure is what the GPU needs per step, the gaps between its kernels
included, whatever the host does (end-to-end runs of the 0.5B shape are host-bound and move by ±10% between
runs on a shared host: they cannot show a few microseconds per kernel). Two engines of one process, one
captured with PDL and one without ($DEEPINFER_DISABLE_PDL=1); their replays alternate round by round
(`--rounds` rounds of `--replays` replays each), medians and spread per arm. The graph covers the layers
(no LM head, no sampling).

    python3 benchmarks/pdl_replay.py --shapes qwen2.5-0.5b,llama-3.1-8b --out pdl.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_throughput import arm_env, make_llm, random_prompts
from common import JsonOut, spread
from shapes import SHAPES, write_shape

ARMS = {"pdl": "deterministic", "nopdl": "deterministic+nopdl"}


def decode_graph(llm, bucket: int) -> torch.cuda.CUDAGraph:
    """The engine's captured decode graph of `bucket` rows, its input ids set to a valid token: after a run
    the overlapped loop may leave placeholders there (filled on the device only by the step that reads
    them), and the graph replays whatever its static buffers hold."""
    graphs = llm.engine.executor.graphs
    if graphs is None or bucket not in graphs._graphs:
        raise SystemExit(f"no captured decode graph for bucket {bucket} (CUDA graphs off?)")
    graphs.buffers.input_ids[:bucket].fill_(100)
    return graphs._graphs[bucket][0]


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean device µs per replay over `replays` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def bench_shape(shape: str, root: Path, batch: int, prompt_len: int, rounds: int, replays: int) -> dict:
    from deepinfer.engine import SamplingParams

    model_dir = write_shape(shape, root)
    prompts = random_prompts(batch, prompt_len, SHAPES[shape]["vocab_size"])
    blocks = batch * -(-(prompt_len + 32) // 16) + 64
    graphs, keep = {}, []
    for arm, mode in ARMS.items():
        with arm_env(mode):   # graphs are captured inside: with or without PDL for good
            llm = make_llm(model_dir, prompts, 8, True, False, None, 16384, kv_blocks=blocks)
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
        graphs[arm] = decode_graph(llm, batch)
        keep.append(llm)
    for g in graphs.values():
        replay_us(g, 20)   # warm
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
            times[arm].append(replay_us(graphs[arm], replays))
    res = {arm: spread(v) for arm, v in times.items()}
    res["pdl_vs_nopdl"] = res["pdl"]["median"] / res["nopdl"]["median"]
    del keep
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=256, help="decode rows (a graph bucket)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = JsonOut(args.out)
    report = {"bench": "pdl_replay", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
              "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            res = bench_shape(shape, Path(tmp), args.batch, args.prompt_len, args.rounds, args.replays)
            report["shapes"][shape] = res
            print(f"{shape}: PDL {res['pdl']['median']:.1f} us/step ({res['pdl']['min']:.1f}-"
                  f"{res['pdl']['max']:.1f}), plain {res['nopdl']['median']:.1f} ({res['nopdl']['min']:.1f}-"
                  f"{res['nopdl']['max']:.1f}): x{res['pdl_vs_nopdl']:.4f}", flush=True)
    out.summary(report)


if __name__ == "__main__":
    main()
