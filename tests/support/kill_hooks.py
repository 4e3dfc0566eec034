"""Fault injection for the commit-protocol and chaos tests: SIGKILL or a pause at named points of OutputStore.

The product has only a seam (output/commit.py: ``OutputStore(hooks=...)`` and ``OutputStore.default_hooks``,
both None unless a test sets them). This module fills it from ``DEEPINFER_TEST_KILL_AT="point:n[,...]"``:
the process (its whole process group when it leads one) is SIGKILLed the n-th time it reaches `point`;
and from ``DEEPINFER_TEST_PAUSE_AT="point:n[,...]"``: the process sleeps there (at most PAUSE_S), so a test
can deliver a signal while the run is certainly in progress (a tiny job may otherwise finish between the
test seeing its first commit and the signal). ``python -m tests.support.killable_cli ...`` runs
deepinfer-job with the hooks installed.
"""

from __future__ import annotations

import os
import signal
import time

from deepinfer.pipeline.output.commit import KILL_POINTS, OutputStore

KILL_ENV = "DEEPINFER_TEST_KILL_AT"
PAUSE_ENV = "DEEPINFER_TEST_PAUSE_AT"
PAUSE_S = 60.0


def parse_kill_spec(text: str, env: str = KILL_ENV) -> dict[str, int]:
    """``"point:n,point:n"`` -> {point: n}; ValueError naming the bad entry and `env`."""
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        point, _, n = item.partition(":")
        n = n or "1"
        if point not in KILL_POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{env}: bad entry {item!r}; expected point:n with point in {KILL_POINTS}")
        out[point] = int(n)
    return out


class KillAt:
    """CommitHooks that SIGKILL the process the n-th time a point is reached (`spec`), or pause it there
    (`pause`: a signal's handler still runs during the sleep, e.g. SIGINT's KeyboardInterrupt)."""

    def __init__(self, spec: str, pause: str = "") -> None:
        self.kill_at = parse_kill_spec(spec)
        self.pause_at = parse_kill_spec(pause, PAUSE_ENV)
        self.hits: dict[str, int] = {}

    def reached(self, point: str) -> None:
        self.hits[point] = self.hits.get(point, 0) + 1
        if self.kill_at.get(point) == self.hits[point]:
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.pause_at.get(point) == self.hits[point]:
            time.sleep(PAUSE_S)


def from_env() -> KillAt | None:
    """The hooks the environment asks for, or None."""
    spec, pause = os.environ.get(KILL_ENV, ""), os.environ.get(PAUSE_ENV, "")
    return KillAt(spec, pause) if spec.strip() or pause.strip() else None


def install_from_env() -> None:
    """Give every OutputStore of this process the environment's kill hooks (a no-op when unset)."""
    OutputStore.default_hooks = from_env()
