"""Preparing a job's parts ahead of the engine, on one background thread, with a bounded look-ahead.

The in-process executor (local.py) hands each part's CPU work — read, prompt, tokenize, length-sort
(stages/plan.prepare_part) — to a `PartPrefetcher`, so that it overlaps the engine: the first part is
prepared while the engine builds its model, and part N+1 while part N generates. Parts come out in input
order. At most `ahead` parts are prepared (or being prepared) beyond those the consumer has taken, so the
memory held stays bounded whatever the job's size: with ahead=1, one part waits while one generates.

Errors: an exception in a part's preparation is raised by `next_part()` in the consumer's thread (the
same exception object, so the CLI reports it with the exit code it always had) and the thread stops.
`close()` cancels the thread and joins it: a preparation under way finishes first (it cannot be
interrupted; it is one part's CPU work), then the thread ends — the consumer never waits on a thread
that is blocked forever, whichever side failed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
from deepinfer.pipeline.parts import PartTask


@dataclass
class PrefetchCounters:
    """What the prefetcher did, for tests and the curious (no timing): parts whose preparation started,
    finished, were taken by the consumer, and the largest lead (started - taken) it ever had."""

    started: int = 0
    prepared: int = 0
    taken: int = 0
    max_lead: int = 0


class PartPrefetcher:
    """Prepare `parts` in order on a background thread, `ahead` parts ahead of the consumer at most;
    with `hold`, only once `release()` is called (`held` is set while it waits for that).

    `next_part()` returns the next prepared part (waiting for it); `close()` stops the thread (also on
    exit of a `with` block). `waiting_for_slot` is set while the thread waits for the consumer to take a
    part (the look-ahead is full) and cleared as the consumer takes one: a test can wait on it instead
    of on time.
    """

    def __init__(self, prepare: Callable[[PartTask], pa.Table], parts: Sequence[PartTask],
                 ahead: int = 1, hold: bool = False) -> None:
        if ahead < 1:
            raise ValueError(f"ahead={ahead}: the prefetcher prepares at least one part ahead (use the "
                             "sequential executor path for none)")
        self._prepare, self._parts, self.ahead = prepare, list(parts), ahead
        self.counters = PrefetchCounters()
        self.waiting_for_slot = threading.Event()
        self.held = threading.Event()  # set while a held prefetcher waits for release()
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self._cond = threading.Condition()
        self._ready: deque[pa.Table] = deque()
        self._error: BaseException | None = None
        self._done = False  # the thread ended (all parts prepared, an error, or cancelled)
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-prepare-parts", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let a prefetcher made with hold=True start preparing (idempotent)."""
        self._go.set()

    def _run(self) -> None:
        c = self.counters
        try:
            if not self._go.is_set():
                self.held.set()
                self._go.wait()
                self.held.clear()
            for task in self._parts:
                with self._cond:
                    while not self._cancelled and c.started - c.taken >= self.ahead:
                        self.waiting_for_slot.set()
                        self._cond.wait()
                    self.waiting_for_slot.clear()
                    if self._cancelled:
                        return
                    c.started += 1
                    c.max_lead = max(c.max_lead, c.started - c.taken)
                table = self._prepare(task)  # outside the lock: the consumer takes parts meanwhile
                with self._cond:
                    self._ready.append(table)
                    c.prepared += 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's thread by next_part()
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def next_part(self) -> pa.Table:
        """The next part's prepared table, in input order; re-raises a preparation's exception."""
        with self._cond:
            while not self._ready and not self._done:
                self._cond.wait()
            if self._ready:
                self.counters.taken += 1
                self.waiting_for_slot.clear()  # here, not when the thread wakes: no stale "waiting"
                self._cond.notify_all()  # a slot is free: the thread prepares the next part
                return self._ready.popleft()
            if self._error is not None:
                raise self._error
        raise RuntimeError("PartPrefetcher.next_part: every part was already taken (or it was closed)")

    def close(self) -> None:
        """Cancel the parts not yet started and join the thread (after the preparation under way)."""
        with self._cond:
            self._cancelled = True
            self._ready.clear()
            self._cond.notify_all()
        self._go.set()
        self._thread.join()

    def __enter__(self) -> PartPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
