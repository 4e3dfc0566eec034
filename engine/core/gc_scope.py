"""The cyclic garbage collector kept quiet during an engine run.

A full (generation 2) collection scans every object the collector tracks: the model's modules, the engine,
the tokenizer, the caller's data — hundreds of thousands of objects. The step loop allocates enough to set
one off in most runs (8 of 10 runs of 256 x 200 tokens on the development VM, `benchmarks/gc_pauses.py`,
benchmarks/RESULTS.md), and it stops the host for 102-132 ms: in a host-bound run (a small model, whose
device waits on the host every step) that is a stall of the device too, ~10% of a one-second run, landing
in some runs and not others. The young generation's collections add ~0.1 ms per step (one almost every
step at CPython's default threshold of 700 allocations).

`quiet_gc` moves every object alive when a run starts into the collector's permanent generation for the
run (`gc.freeze`) and back into the oldest generation when it ends (`gc.unfreeze`), so collections during
the run scan only what the run created and nothing stays out of the collector's reach after it; and it
raises the young generation's threshold for the run (most of a step's objects die young: fewer, larger
collections find them dead). Measured there: no full collection in any run, collector time per run
126 -> 3.8 ms (medians of 5), longest pause 3.5 ms.

Where something else froze objects already (a server that froze its start-up heap, or another engine's run
in this process), or turned the collector off, the run leaves the collector as it is: unfreezing would
hand back objects it did not freeze. $DEEPINFER_DISABLE_QUIET_GC=1 leaves it as it is too (A/B runs).

A scope nested in another of the same context (the engine's run inside `LLM.generate`'s) is a no-op and
never asks the collector for its freeze count: `gc.get_freeze_count()` walks the whole permanent generation
(29 ms for 466k objects on the development VM), and inside a scope that generation is the whole heap.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

DISABLE_ENV = "DEEPINFER_DISABLE_QUIET_GC"   # 1: CPython's defaults during runs (A/B benchmarks)
# Allocations (net, of objects the collector tracks) between young-generation collections during a run.
RUN_GEN0_THRESHOLD = 10_000
# True inside a quiet scope of this context (thread / task): nested scopes are then no-ops.
_INSIDE: ContextVar[bool] = ContextVar("deepinfer_quiet_gc_inside", default=False)


@contextmanager
def quiet_gc() -> Iterator[None]:
    """Within the block, objects that existed at its start are not scanned by the cyclic collector and the
    young generation is collected less often; both are undone when the block ends."""
    if _INSIDE.get():   # the enclosing scope froze the heap already and will hand it back
        yield
        return
    if not gc.isenabled() or gc.get_freeze_count() or os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        yield
        return
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], RUN_GEN0_THRESHOLD), *threshold[1:])
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)
        gc.set_threshold(*threshold)
        gc.unfreeze()
