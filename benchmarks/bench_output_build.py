"""Host time to build the outputs of requests that finish in the same engine step (CPU only).

When every request of a call ends in its last step (fixed-length outputs, as in bench_throughput.py), the
device is idle while the host turns them into `RequestOutput`s; most of that is decoding their texts. This
times `OutputProcessor.build_output` one request at a time (the engine until 2026-12-04) against
`OutputProcessor.build_outputs` (one batched decode per step), on the demo tokenizer, with output ids
drawn from its own vocabulary (real text) and from a 151,936-id range (bench_throughput.py's random ids,
mostly unknown to the demo tokenizer). The texts are checked equal. Median (min-max) of --runs.

    python3 benchmarks/bench_output_build.py --requests 256 --prompt-len 512 --output-len 256 --runs 7
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()

    from deepinfer.engine import SamplingParams
    from deepinfer.engine.core.sequence import Sequence
    from deepinfer.engine.models.demo import write_tokenizer_files
    from deepinfer.engine.text.output_processor import OutputProcessor
    from deepinfer.engine.text.tokenizer import Tokenizer

    d = Path(tempfile.mkdtemp())
    write_tokenizer_files(d)
    tok = Tokenizer.from_dir(d)
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=args.output_len)
    print(f"cpus {os.cpu_count()}, {args.requests} requests x {args.prompt_len} prompt ids -> "
          f"{args.output_len} output ids, {args.runs} runs")
    for label, vocab in (("demo vocabulary", tok.vocab_size), ("151,936-id range", 151936)):
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        outputs = [[rng.randrange(vocab) for _ in range(args.output_len)] for _ in range(args.requests)]


        times: dict[str, list[float]] = {"one at a time": [], "together": []}
        for _ in range(args.runs):
            a, b = (_finished(Sequence, prompts, outputs, params) for _ in range(2))
            t0 = time.perf_counter()
            alone = [proc.build_output(s, None) for s in a]
            t1 = time.perf_counter()
            together = proc.build_outputs(b, [None] * len(b))
            t2 = time.perf_counter()
            times["one at a time"].append((t1 - t0) * 1e3)
            times["together"].append((t2 - t1) * 1e3)
            if [o.outputs[0].text for o in alone] != [o.outputs[0].text for o in together]:
                raise SystemExit("texts differ between the two forms")
        for name, ms in times.items():
            print(f"{label}: {name} {statistics.median(ms):.2f} ms ({min(ms):.2f}-{max(ms):.2f})")


def _finished(sequence_cls, prompts: list[list[int]], outputs: list[list[int]], params) -> list:
    """Finished sequences holding these prompt and output ids."""
    seqs = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        seq = sequence_cls(i, p, params, seed=i)
        seq.output_token_ids.extend(o)
        seqs.append(seq)
    return seqs


if __name__ == "__main__":
    main()
