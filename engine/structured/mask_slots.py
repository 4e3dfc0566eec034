"""Per-request grammar-mask rows, filled ahead of the step on a worker thread.

Why: with a 128k vocabulary a row's mask costs tens to hundreds of microseconds, a 256-request step tens of
milliseconds, longer than a decode forward. Filling them only once the step's batch is known (at sampling)
puts all of that between the forward and the sampling. Instead every constrained request owns a *slot*, a
row of one pinned int32 buffer [capacity, ceil(V/32)], and the fill of its next mask is queued the moment
its grammar has advanced on the token just sampled (manager.advance, called from the finish rules while the
overlapped loop applies step N's tokens, with step N+1's forward already running on the device). Sampling
then waits only for the rows still being filled, and applies the slots directly: the mask kernel reads
logits row i's mask from bitmask row slot[i] (kernels/masking.py), so nothing is gathered on the host.

One worker thread drains the queue: each time it runs it takes every row queued so far and fills them in
one llguidance call (its Rust executor spreads the rows over its threads and holds no GIL meanwhile), so
the worker needs the GIL once per batch, not per row, while the main thread is busy with Python.

A slot is reused only after its fill has finished (release is deferred to the fill's completion), and the
worker waits for the last host->device copy of the buffer (`copied`) before it writes into it again, so a
copy still in flight on the device never reads a half-written row.

With a mask cache (mask_cache.py), a row whose token history (or, for grammars with a state key,
state_key.py, whose grammar state) has a stored mask is a copy of it, and rows of one batch on the same
history or state are filled once and copied; only the rest go to llguidance. Per batch
the worker records its fill time and rows (`batches`), so the benchmark reports the per-step distribution.

Hits are copied at `submit`, on the caller's thread (`inline_hits`), not queued. Why: the engine thread
queues the fills inside the loop that applies a step's tokens and holds the GIL throughout it, so the
worker only runs once the sampler blocks on the masks (measured, fillprobe.py: one worker batch per step,
after the loop); everything queued is then on the critical path, and per row the worker's grouping,
lookup, gather and Future cost more than the 16 KiB copy itself (once number states share keys, >= 99% of
the steady state's rows are hits). A copy at submit needs the device to be done reading the buffer (the
last `copied` event: complete whenever the step's ids were read, which is before any grammar advances);
when it is not, the row is queued as before.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from deepinfer.engine.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
    from deepinfer.engine.structured.mask_cache import HistoryNode, MaskCache

# (slot, matcher, its cache key: a history node, a state key (state_key.py) or None, the Future resolved
# once the row is written)
_Queued = tuple[int, "LLGuidanceMatcher", "HistoryNode | tuple | None", Future]


class MaskSlots:
    """The slot buffer, its free list and the fill queue of one StructuredOutputManager."""

    def __init__(self, backend: LLGuidanceBackend, initial: int = 64, cache: MaskCache | None = None,
                 inline_hits: bool = True) -> None:
        self.backend = backend
        self.cache = cache
        self.inline_hits = inline_hits  # copy stored masks at submit (off: every row through the worker)
        self._pin = torch.cuda.is_available()
        self.buffer = self._alloc(initial)
        self._view = self.buffer.numpy()
        self._free = list(range(initial - 1, -1, -1))
        self._queue: list[_Queued] = []
        self._outstanding: set[Future] = set()
        self._running = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-mask-fill")
        self._copied: torch.cuda.Event | None = None
        self._copied_seen: torch.cuda.Event | None = None  # the last `_copied` found complete
        self.done: Future = Future()  # the one resolved Future of every row copied at submit
        self.done.set_result(None)
        # Counters (read by StructuredOutputManager.mask_stats).
        self.fill_seconds = 0.0     # worker time inside llguidance fills
        self.worker_rows = 0        # rows written by the worker (only it counts these)
        self.inline_rows = 0        # rows copied at submit (inline_hits; only the caller's thread counts)
        self.fill_batches = 0
        self.fill_log: list[tuple[float, float, int]] = []  # (end time, seconds, rows) per batch (bounded)

    @property
    def filled_rows(self) -> int:
        """Rows written, by the worker or copied at submit (two counters: each has one writing thread)."""
        return self.worker_rows + self.inline_rows

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.backend.words), -1, dtype=torch.int32, pin_memory=self._pin)

    # ---- slots (main thread) ------------------------------------------------------------------------
    def acquire(self) -> int:
        """A free slot; the buffer doubles (after the fills in flight finish) when none is left."""
        with self._lock:
            if self._free:
                return self._free.pop()
        self.wait_idle()
        with self._lock:
            old = self.buffer
            grown = self._alloc(2 * old.shape[0])
            grown[: old.shape[0]].copy_(old)
            self.buffer = grown
            self._view = grown.numpy()
            self._free.extend(range(grown.shape[0] - 1, old.shape[0], -1))
            return old.shape[0]

    def release(self, slot: int, fill: Future | None) -> None:
        """Give `slot` back, once its fill (if any) has finished writing it."""
        if slot < 0:
            return
        if fill is None or fill.done():
            with self._lock:
                self._free.append(slot)
            return

        def give_back(_: Future) -> None:
            with self._lock:
                self._free.append(slot)

        fill.add_done_callback(give_back)

    # ---- fills ----------------------------------------------------------------------------------------
    def submit(self, slot: int, matcher: LLGuidanceMatcher,
               node: HistoryNode | tuple | None = None) -> Future:
        """Queue the fill of `slot` from `matcher`'s current state (`node`: its token history in the mask
        cache or its state key, None when it has none); the Future resolves when the row is written. A row
        whose key has a stored mask is copied here and gets an already resolved Future (`inline_hits`)."""
        cache = self.cache
        if cache is not None and node is not None and self.inline_hits and self._device_done():
            if cache.copy_stored(node, self._view[slot]):
                self.inline_rows += 1
                return self.done
        fut: Future = Future()
        with self._lock:
            self._queue.append((slot, matcher, node, fut))
            self._outstanding.add(fut)
            start = not self._running
            self._running = True
        if start:
            self._pool.submit(self._drain)
        return fut

    def _device_done(self) -> bool:
        """Whether the device has finished reading the buffer (its last copy), so rows may be written."""
        ev = self._copied
        if ev is None or ev is self._copied_seen:
            return True
        if ev.query():
            self._copied_seen = ev
            return True
        return False

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._running = False
                    return
            copied = self._copied
            if copied is not None:
                copied.synchronize()  # the device has finished reading the previous step's rows
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                self._fill(batch)
            except BaseException as e:  # handed to the waiting sampler, never lost on this thread
                error = e
            t1 = time.perf_counter()
            self.fill_seconds += t1 - t0
            self.worker_rows += len(batch)
            self.fill_batches += 1
            if len(self.fill_log) < 1_000_000:
                self.fill_log.append((t1, t1 - t0, len(batch)))
            with self._lock:
                for *_, fut in batch:
                    self._outstanding.discard(fut)
            for *_, fut in batch:
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)

    def _fill(self, batch: list[_Queued]) -> None:
        """Write the queued rows: stored masks and same-key duplicates by copy, the rest by llguidance."""
        cache, buf = self.cache, self.buffer
        if cache is None:
            self.backend.fill_bitmasks([(slot, m) for slot, m, _, _ in batch], buf)
            return
        view = buf.numpy()
        compute: list[tuple[int, LLGuidanceMatcher]] = []
        # id(node) or the state key -> [node or key, its first slot, its matcher, the other slots on it]
        groups: dict[int | tuple, list] = {}
        for slot, m, node, _ in batch:
            if node is None:
                compute.append((slot, m))
                continue
            key = node if isinstance(node, tuple) else id(node)
            group = groups.get(key)
            if group is None:
                groups[key] = [node, slot, m, []]
            else:
                group[3].append(slot)
        found = cache.lookup_rows([g[0] for g in groups.values()], [1 + len(g[3]) for g in groups.values()])
        dst: list[int] = []
        src: list[int] = []
        missing = []
        for group, row in zip(groups.values(), found):
            if row >= 0:
                dst.append(group[1])
                dst.extend(group[3])
                src.extend([row] * (1 + len(group[3])))
            else:
                compute.append((group[1], group[2]))
                missing.append(group)
        table = cache.table
        for d, r in zip(dst, src):  # row by row: no temporary (a fancy-index gather copies twice)
            np.copyto(view[d], table[r])
        self.backend.fill_bitmasks(compute, buf)
        for node, slot, _, copies in missing:
            if copies:
                view[copies] = view[slot]
                cache.count_shared(len(copies))
            cache.store(node, view[slot], shared=bool(copies))

    def wait_idle(self) -> None:
        """Wait until no fill is queued or running."""
        while True:
            with self._lock:
                pending = list(self._outstanding)
            if not pending:
                return
            for fut in pending:
                fut.exception()

    def copied(self, event: torch.cuda.Event | None) -> None:
        """Record the device copy that reads the buffer; later fills wait for it before writing."""
        self._copied = event

    def close(self) -> None:
        self._pool.shutdown(wait=True)
