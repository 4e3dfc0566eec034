"""Fault injection for the commit-protocol and chaos tests: SIGKILL at named points of OutputStore.

The product has only a seam (output/commit.py: ``OutputStore(hooks=...)`` and ``OutputStore.default_hooks``,
both None unless a test sets them). This module fills it from ``DEEPINFER_TEST_KILL_AT="point:n[,...]"``:
the process (its whole process group when it leads one) is SIGKILLed the n-th time it reaches `point`.
``python -m tests.support.killable_cli ...`` runs deepinfer-job with the hook installed.
"""

from __future__ import annotations

import os
import signal

from deepinfer.pipeline.output.commit import KILL_POINTS, OutputStore

KILL_ENV = "DEEPINFER_TEST_KILL_AT"


def parse_kill_spec(text: str) -> dict[str, int]:
    """``"point:n,point:n"`` -> {point: n}; ValueError naming the bad entry."""
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        point, _, n = item.partition(":")
        n = n or "1"
        if point not in KILL_POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{KILL_ENV}: bad entry {item!r}; expected point:n with point in {KILL_POINTS}")
        out[point] = int(n)
    return out


class KillAt:
    """CommitHooks that SIGKILL the process the n-th time a point is reached."""

    def __init__(self, spec: str) -> None:
        self.kill_at = parse_kill_spec(spec)
        self.hits: dict[str, int] = {}

    def reached(self, point: str) -> None:
        self.hits[point] = self.hits.get(point, 0) + 1
        if self.kill_at.get(point) == self.hits[point]:
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> KillAt | None:
    """The hooks the environment asks for, or None."""
    spec = os.environ.get(KILL_ENV, "")
    return KillAt(spec) if spec.strip() else None


def install_from_env() -> None:
    """Give every OutputStore of this process the environment's kill hooks (a no-op when unset)."""
    OutputStore.default_hooks = from_env()
