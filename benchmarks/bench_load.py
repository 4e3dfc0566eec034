"""Weight loading: safe_open one tensor at a time vs safetensors_stream (big reads into pinned buffers).

    python benchmarks/bench_load.py --shape llama-3.1-8b            # writes a random ~16 GB checkpoint
    python benchmarks/bench_load.py --model /path/to/checkpoint --runs 3
    python benchmarks/bench_load.py --gib 1.5 --device cpu          # a synthetic file; CPU read side only
    python benchmarks/bench_load.py --model DIR --threads 4,8 --chunk-mib 16,64 --readers stream

On CPU safe_open maps the file and reads nothing until a tensor is used (near-zero seconds here), which is
why the engine keeps it on CPU; the CPU figure of `stream` is its read + copy cost only. The comparison
that matters is --device cuda.

Each run yields every tensor of the checkpoint onto --device (what the engine's loader hands to
load_weights) and synchronizes; the two readers alternate, `--runs` times each, after one unmeasured
warm-up of each (page cache, CUDA context, pinned allocator). Reported: median / min / max seconds and
GB/s per reader. Before timing, every tensor is checked equal between the readers (a checksum of its
bytes on the device), so the speed is for the same bits.

Reader settings: `--threads` and `--chunk-mib` take comma lists; every combination is its own `stream`
reader (`stream-t8-c64`: 8 reader threads, 64 MiB pinned buffers, two buffers per thread), passed to
stream_safetensors as arguments (the engine's loader uses its defaults, DEFAULT_READERS and
DEFAULT_CHUNK_BYTES in engine/models/safetensors_stream.py). `--readers stream` leaves safe_open out;
`--warmup 0` skips the warm-ups (the page cache already holds a checkpoint just written or loaded).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _files(model_dir: Path) -> list[Path]:
    from deepinfer.engine.models.loader import weight_files

    kind, files = weight_files(model_dir)
    if kind != "safetensors":
        raise SystemExit(f"{model_dir}: safetensors only")
    return files


def _safe_open(files: list[Path], device: str):
    from safetensors import safe_open

    for p in files:
        with safe_open(str(p), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def _stream(files: list[Path], device: str, threads: int | None = None, chunk_mib: int | None = None):
    from deepinfer.engine.models import safetensors_stream as st

    readers = threads or st.DEFAULT_READERS
    chunk = (chunk_mib << 20) if chunk_mib else st.DEFAULT_CHUNK_BYTES
    yield from st.stream_safetensors(files, device, chunk_bytes=chunk, num_buffers=2 * readers,
                                     num_readers=readers)


def make_readers(names: list[str], threads: list[int], chunk_mib: list[int]) -> dict:
    """name -> reader(files, device): safe_open, and one stream reader per (threads, chunk) setting."""
    readers: dict = {}
    if "safe_open" in names:
        readers["safe_open"] = _safe_open
    if "stream" in names:
        for t in threads:
            for c in chunk_mib:
                name = "stream" if len(threads) == len(chunk_mib) == 1 else f"stream-t{t}-c{c}"
                readers[name] = functools.partial(_stream, threads=t, chunk_mib=c)
    return readers


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of bytes, position-weighted sum of bytes) of a tensor, on its device, in 16 MiB slices."""
    b = t.reshape(-1).view(torch.uint8)
    s1 = s2 = 0
    step = 16 << 20
    for lo in range(0, b.numel(), step):
        x = b[lo:lo + step].to(torch.int64)
        w = torch.arange(lo, lo + x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
        s1 += int(x.sum())
        s2 += int((x * w).sum())
    return s1, s2


def timed(reader, files: list[Path], device: str) -> tuple[float, int]:
    _sync(device)
    t0 = time.perf_counter()
    n = 0
    for _, t in reader(files, device):
        n += t.numel() * t.element_size()
    _sync(device)
    return time.perf_counter() - t0, n


def write_synthetic(root: Path, gib: float) -> Path:
    """A checkpoint of bf16 [4096, 14336]-sized tensors (~112 MiB each) totalling about `gib` GiB."""
    from safetensors.torch import save_file

    d = root / "synthetic"
    d.mkdir(parents=True, exist_ok=True)
    one = 4096 * 14336 * 2
    count = max(1, int(gib * 2**30 // one))
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(4096, 14336, generator=g).to(torch.bfloat16) for i in range(count)}
    save_file(sd, str(d / "model.safetensors"))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="an existing checkpoint directory")
    src.add_argument("--shape", help="write bench_pipeline's random checkpoint of this shape (llama-3.1-8b)")
    src.add_argument("--gib", type=float, help="write a synthetic checkpoint of this many GiB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the bytes-equal check")
    ap.add_argument("--readers", default="safe_open,stream", help="comma list of safe_open, stream")
    ap.add_argument("--threads", default="4", help="stream reader threads, comma list (e.g. 4,8)")
    ap.add_argument("--chunk-mib", default="16", help="stream pinned buffer MiB, comma list (e.g. 16,64)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each reader first")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        elif args.gib:
            model_dir = write_synthetic(Path(tmp), args.gib)
        else:
            from bench_pipeline import write_random_checkpoint

            t0 = time.perf_counter()
            model_dir = write_random_checkpoint(args.shape or "llama-3.1-8b", Path(tmp))
            print(f"wrote {model_dir} in {time.perf_counter() - t0:.1f} s", flush=True)
        files = _files(model_dir)
        readers = make_readers(args.readers.split(","), _ints(args.threads), _ints(args.chunk_mib))
        if not readers:
            raise SystemExit(f"--readers {args.readers}: expected safe_open and/or stream")
        if not args.no_check and len(readers) > 1:
            sums = {r: {n: _checksum(t) for n, t in fn(files, args.device)} for r, fn in readers.items()}
            first = next(iter(sums))
            for r, got in sums.items():
                if got != sums[first]:
                    bad = [n for n in sums[first] if sums[first][n] != got.get(n)]
                    raise SystemExit(f"{r} and {first} differ on {len(bad)} tensors, e.g. {bad[:3]}")
            print(f"bytes equal: {len(sums[first])} tensors, {len(sums)} readers", flush=True)
        for _ in range(args.warmup):
            for fn in readers.values():
                timed(fn, files, args.device)
        seconds: dict[str, list[float]] = {r: [] for r in readers}
        nbytes = 0
        for _ in range(args.runs):
            for r, fn in readers.items():  # alternate readers so drift falls on all alike
                dt, nbytes = timed(fn, files, args.device)
                seconds[r].append(dt)
        result = {"device": args.device, "bytes": nbytes, "files": len(files), "runs": seconds}
        for r, s in seconds.items():
            med = statistics.median(s)
            result[r] = {"median_s": med, "min_s": min(s), "max_s": max(s), "gb_per_s": nbytes / med / 1e9}
            print(f"{r:14s} median {med:7.2f} s (min {min(s):.2f}, max {max(s):.2f})  "
                  f"{nbytes / med / 1e9:6.2f} GB/s  ({nbytes / 1e9:.2f} GB, {args.device})", flush=True)
        fastest = min((r for r in seconds if r != "safe_open"), key=lambda r: result[r]["median_s"],
                      default=None)
        if fastest is not None:
            print(f"fastest stream setting: {fastest}", flush=True)
            if "safe_open" in seconds:
                ratio = statistics.median(seconds["safe_open"]) / result[fastest]["median_s"]
                print(f"{fastest} is {ratio:.2f}x safe_open (medians)")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
