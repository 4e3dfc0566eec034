"""The job record (``_job.json``) an output is opened with, and what opening it found (:class:`ResumeState`).

Both belong to the commit protocol (commit.py re-exports them); they live here to keep that file to the
protocol itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.pipeline.output.encoding import check_format
from deepinfer.pipeline.parts import PartSpec

JOB_RECORD_VERSION = 1


def make_job_record(
    spec: Mapping[str, Any], fingerprint: Mapping, parts: Sequence[PartSpec], fmt: str
) -> dict:
    """The ``_job.json`` content :meth:`OutputStore.begin` expects. ``spec`` must hold no secrets."""
    check_format(fmt)
    return {
        "deepinfer_job": JOB_RECORD_VERSION,
        "spec": dict(spec),
        "fingerprint": dict(fingerprint),
        "format": fmt,
        "num_parts": len(parts),
        "num_rows": sum(p.num_rows for p in parts),
        "parts": [p.to_dict() for p in parts],
    }


@dataclass(frozen=True)
class ResumeState:
    """What :meth:`OutputStore.begin` found.

    ``committed``: part ids already committed (skip them). ``complete``: ``_SUCCESS`` exists, nothing to do
    and nothing was written. ``resumed``: an earlier run of the same job existed. ``restarted``: an old
    output was deleted (--restart). ``orphans_removed``: leftovers of killed runs deleted by this begin.
    """

    committed: frozenset[str]
    complete: bool
    resumed: bool
    restarted: bool
    orphans_removed: int
