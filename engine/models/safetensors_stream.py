"""Safetensors files to a CUDA device at disk / PCIe speed: big sequential reads into pinned buffers.

`safe_open(device="cuda")` maps the file and moves one tensor at a time: page faults over the mapping, then
a pageable host-to-device copy (staged by the driver through its own bounce buffer), one after the other,
so a 16 GB checkpoint loads at ~2 GB/s. Here reader threads read each file's data section in fixed-size
byte ranges (`chunk_bytes`, whole tensors or pieces of them) with plain `preadv` calls into a ring of
pinned host buffers, while the caller's thread copies each range, non-blocking, into the device tensors it
overlaps. The bytes are the file's bytes, so every tensor is bit for bit what safe_open gives (the tests
compare every tensor both ways).

A pinned buffer is refilled only after the copies out of it have finished (a CUDA event recorded after
them, waited on by the reader). Each tensor gets its own device allocation (nothing yielded aliases a
buffer that is reused later), and is yielded once its last byte has been copied; copies and the caller's
use of the tensor are ordered on the same (current) stream.

Files whose header this reader does not understand (an unknown dtype, overlapping or out-of-file offsets)
go through safe_open instead (`stream_safetensors` falls back per file).
"""

from __future__ import annotations

import bisect
import json
import os
import queue
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Reads of this size keep a disk and PCIe busy with few calls while staying cache-friendly for the copy
# out of the page cache; 2 buffers per reader thread (256 MiB pinned in all at 8 readers) keep every
# reader busy while the copies out of the others run, without a long pin at start-up. 8 readers: on an
# H200 host a page-cached 16 GB checkpoint loaded at 22.3 GB/s (8 x 16 MiB) vs 14.5 (4 x 16 MiB), 15.7
# (8 x 64 MiB) and 10.4 (4 x 64 MiB) (benchmarks/bench_load.py --threads 4,8 --chunk-mib 16,64); a
# page-cache read is a kernel memcpy on the reading thread, so machines with fewer cores keep 4.
DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_READERS = 8 if (os.cpu_count() or 1) >= 8 else 4
DEFAULT_BUFFERS = 2 * DEFAULT_READERS
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its bytes are [start, end) of the file (absolute offsets)."""

    name: str
    dtype: str          # torch dtype name (torch.<dtype>)
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str | Path) -> list[TensorEntry] | None:
    """The file's tensors in file order, or None when this reader cannot take the file (then use
    safe_open): an unknown dtype, sizes that do not match shapes, overlapping or out-of-file ranges."""
    import torch

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return None
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            return None
        header = json.loads(f.read(n))
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None or not hasattr(torch, dtype):
            return None
        shape = tuple(int(d) for d in info["shape"])
        lo, hi = (int(x) for x in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if hi - lo != numel * getattr(torch, dtype).itemsize or lo < 0 or base + hi > size:
            return None
        entries.append(TensorEntry(name, dtype, shape, base + lo, base + hi))
    entries.sort(key=lambda e: e.start)
    for a, b in zip(entries, entries[1:]):
        if b.start < a.end:
            return None
    return entries


def _chunks(entries: list[TensorEntry], chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of at most chunk_bytes covering every tensor's bytes, in file order (gaps
    between tensors are skipped when a new range can start at the next tensor)."""
    out: list[tuple[int, int]] = []
    for e in entries:
        pos = e.start
        if out and out[-1][1] == pos and out[-1][1] - out[-1][0] < chunk_bytes:
            lo, _ = out.pop()   # extend the previous range up to chunk_bytes
            hi = min(e.end, lo + chunk_bytes)
            out.append((lo, hi))
            pos = hi
        while pos < e.end:
            hi = min(e.end, pos + chunk_bytes)
            out.append((pos, hi))
            pos = hi
    return out


class _RangeReader:
    """Threads reading byte ranges of one file into a ring of host buffers (in any order).

    `ready` yields (range, buffer index); the consumer hands a buffer back with `release(i, event)` and a
    reader waits for `event` (the copies out of that buffer) before refilling it. Several readers keep
    more than one core copying out of the page cache (one reaches ~4-6 GB/s)."""

    def __init__(self, path: str | Path, ranges: list[tuple[int, int]], buffers: list[torch.Tensor],
                 num_readers: int) -> None:
        self.path, self.ranges, self.buffers = path, ranges, buffers
        self.ready: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        for i in range(len(buffers)):
            self.free.put((i, None))
        self._next = iter(range(len(ranges)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"deepinfer-weight-reader-{k}", daemon=True)
                         for k in range(max(1, min(num_readers, len(ranges))))]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        try:
            with open(self.path, "rb", buffering=0) as f:
                while True:
                    i, event = self.free.get()
                    if self._stop.is_set():
                        return
                    with self._lock:
                        k = next(self._next, None)
                    if k is None:
                        self.free.put((i, event))   # another reader may still need a buffer
                        return
                    if event is not None:
                        event.synchronize()
                    lo, hi = self.ranges[k]
                    view = memoryview(self.buffers[i].numpy())[: hi - lo]
                    got = 0
                    while got < hi - lo:
                        n = os.preadv(f.fileno(), [view[got:]], lo + got)
                        if not n:
                            raise OSError(f"{self.path}: file ended at byte {lo + got}, expected {hi}")
                        got += n
                    self.ready.put(((lo, hi), i))
        except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
            self._stop.set()
            self.ready.put(exc)

    def release(self, i: int, event: object) -> None:
        self.free.put((i, event))

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:   # wake readers waiting for a buffer
            self.free.put((0, None))
        for t in self._threads:
            t.join()


def _stream_file(path: str | Path, entries: list[TensorEntry], device: torch.device,
                 buffers: list[torch.Tensor], chunk_bytes: int, num_readers: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    cuda = device.type == "cuda"
    # Zero-byte tensors have no range to complete them; the others are disjoint and sorted by offset.
    for e in entries:
        if e.end == e.start:
            yield e.name, torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
    entries = [e for e in entries if e.end > e.start]
    ranges = _chunks(entries, chunk_bytes)
    starts = [e.start for e in entries]
    dst: dict[int, torch.Tensor] = {}   # entry index -> its device bytes (allocated on its first range)
    left = [e.end - e.start for e in entries]
    reader = _RangeReader(path, ranges, buffers, num_readers)
    try:
        for _ in ranges:
            item = reader.ready.get()
            if isinstance(item, BaseException):
                raise item
            (lo, hi), i = item
            buf = buffers[i]
            done = []
            k = max(0, bisect.bisect_right(starts, lo) - 1)
            while k < len(entries) and entries[k].start < hi:
                e = entries[k]
                a, b = max(e.start, lo), min(e.end, hi)
                if a < b:
                    out = dst.get(k)
                    if out is None:
                        out = dst[k] = torch.empty(e.end - e.start, dtype=torch.uint8, device=device)
                    out[a - e.start:b - e.start].copy_(buf[a - lo:b - lo], non_blocking=cuda)
                    left[k] -= b - a
                    if left[k] == 0:
                        done.append(k)
                k += 1
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            reader.release(i, event)
            for k in done:
                e = entries[k]
                yield e.name, dst.pop(k).view(getattr(torch, e.dtype)).reshape(e.shape)
        if dst or any(left):
            raise RuntimeError(f"{path}: {len(dst)} tensors were not read completely")
    finally:
        reader.close()
        if cuda:
            # The next file's reader starts with every buffer free: the copies out of them must be done.
            torch.cuda.current_stream(device).synchronize()


def stream_safetensors(files: list[Path], device: torch.device | str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       num_buffers: int = DEFAULT_BUFFERS, num_readers: int = DEFAULT_READERS
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of `files`, each on `device` as soon as all its bytes are
    there (not in file order); bit for bit what safe_open(device=device) yields. Pinned buffers when
    `device` is CUDA (plain ones otherwise: tests)."""
    import torch

    if chunk_bytes < 1 or num_buffers < 2 or num_readers < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}, num_buffers={num_buffers}, num_readers={num_readers}: "
                         "need >= 1, >= 2 and >= 1")
    device = torch.device(device)
    buffers: list[torch.Tensor] | None = None
    for path in files:
        entries = read_header(path)
        if entries is None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
            continue
        if buffers is None:
            pin = device.type == "cuda"
            buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin)
                       for _ in range(num_buffers)]
        yield from _stream_file(path, entries, device, buffers, chunk_bytes, num_readers)
