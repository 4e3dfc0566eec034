"""Which numerics stack computed a job's parts, and the rule that a deterministic job keeps to one.

A deterministic engine's bits depend on the stack it computes with (engine/runner/numerics_stack.py: device
kind and architecture, torch, CUDA, Triton). A job killed on one machine and resumed on another (a GPU
node, then a laptop under model.device 'auto'; an H200, then an A100; a torch upgrade in between) would
otherwise commit parts of two kinds of bits into one output, which equals neither machine's uninterrupted
run, and nothing would say so. Hence:

* every row an engine generated carries its engine's stack (``__numerics``), and every commit marker lists
  the stacks of its part's rows (``"numerics"``);
* the first commit of a job records its stack in ``_numerics.json`` by put-if-absent (of two racing first
  commits, one wins and the other is compared with it);
* in a deterministic job (model.deterministic, the default) a part whose rows come from another stack than
  the recorded one, or from several, is refused with NumericsMismatch (exit 4) before any of its objects
  is written; and the driver hands the recorded stack to its engines, which refuse once built, before
  they generate anything (stages/generate.py), so a resume on the wrong machine wastes no part's work;
* a fast-mode job promises no identical bytes: its parts may come from several stacks, which the markers
  and ``deepinfer-job status`` show.

``_numerics.json`` without a committed part (a run that died between writing it and its first marker)
records nothing: a run's orphan cleanup removes it (only while no other run is live, like every orphan),
and so does --restart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.errors import NumericsMismatch
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.layout import NUMERICS_FILE, dumps

__all__ = ["NUMERICS_FILE", "OutputNumerics", "bracketed", "enforced", "part_stacks", "refusal"]
COLUMN = "__numerics"


def enforced(job_record: Mapping) -> bool:
    """Whether the job in `job_record` (``_job.json``) must keep to one stack: deterministic mode."""
    model = (job_record.get("spec") or {}).get("model") or {}
    return bool(model.get("deterministic", True))


def part_stacks(rows: pa.Table) -> list[str]:
    """The distinct stacks of the engines that generated `rows` (ENGINE_SCHEMA), sorted; [] when none ran
    (every row quarantined before the engine, or a stub engine)."""
    if COLUMN not in rows.column_names:
        return []
    return sorted(pc.unique(pc.drop_null(rows.column(COLUMN))).to_pylist())


def bracketed(stacks: Sequence[str]) -> str:
    """Stacks as messages show them: each in brackets (a stack's line holds commas), '; ' between."""
    return "; ".join(f"[{s}]" for s in stacks)


def refusal(recorded: str, found: Sequence[str], where: str) -> NumericsMismatch:
    """The error for `found` stacks meeting an output whose parts were computed with `recorded`."""
    return NumericsMismatch(
        f"{where}: the job's committed parts were computed with {bracketed([recorded])}, but this run "
        f"computes with {bracketed(found)}. A deterministic job's parts must all come from one numerics "
        "stack (device kind and architecture, torch, CUDA and Triton versions), or the output would match "
        "neither machine's uninterrupted run. Resume it where that stack is, or pass --restart to compute "
        "the whole output again here")


class OutputNumerics:
    """One writer's view of an output's ``_numerics.json``; the recorded stack is read once and kept (it
    changes only with --restart, which no run does while another is live)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, url: str, enforce: bool) -> None:
        self.fs, self.path, self.url, self.enforce = fs, path, url, enforce
        self._stack: str | None = None

    def recorded(self) -> str | None:
        """The stack the job's parts were computed with, or None before the first commit."""
        if self._stack is None:
            data = storage.read_bytes(self.fs, self.path)
            self._stack = None if data is None else str(json.loads(data)["numerics"])
        return self._stack

    def expected(self) -> str | None:
        """What this job's engines must compute with: the recorded stack in a deterministic job, else
        None (no constraint)."""
        return self.recorded() if self.enforce else None

    def claim(self, part_id: str, stacks: Sequence[str]) -> None:
        """Before part `part_id` is written: record its stack if it is the job's first, else check it
        (NumericsMismatch in a deterministic job; nothing is written then)."""
        if not stacks:
            return
        where = f"output {self.url}, part {part_id}"
        if self.enforce and len(stacks) > 1:
            raise NumericsMismatch(f"{where}: its rows come from engines with different numerics stacks "
                                   f"({bracketed(stacks)}), so they would not be the bits of one machine; "
                                   "run a deterministic job's engines on one stack")
        if self.recorded() is None and storage.put_if_absent(self.fs, self.path,
                                                             dumps({"numerics": stacks[0]})):
            self._stack = stacks[0]
        recorded = self.recorded()
        if self.enforce and recorded is not None and any(s != recorded for s in stacks):
            raise refusal(recorded, stacks, where)
