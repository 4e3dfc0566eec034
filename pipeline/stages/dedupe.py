"""Duplicate ids: which rows repeat an id that an earlier row of the job already has.

The rule: of all rows with one id, the first in the job's deterministic input order (sorted file paths,
then row order within a file) is processed; every later one is quarantined with code DUPLICATE_ID (stage
'read') and counts against the error budget. Ids compare in their canonical text form (7 and "7" are one
id, as they already are for seeds: stages/prompt.row_id_of).

Why a pass of its own, on the driver, before any part runs: parts complete in any order on Ray, so no
part can decide alone whether its row is the first of its id; and a resumed run must reach the same
verdict as an uninterrupted one. The pass reads only the id column (Parquet: that column, row group by
row group; JSONL: each line), in input order, and is a pure function of the input, so every run agrees.

Memory bound: up to ``max_in_memory`` rows the distinct ids are kept in one set. Above that the ids are
spilled, in input order, into ``ceil(rows / max_in_memory)`` hash partitions on local disk (a temporary
directory, removed afterwards); rows with equal ids land in the same partition and keep their order,
so each partition is deduplicated alone with a set of about ``max_in_memory`` ids. What stays in memory
for the whole job is the positions of the duplicates themselves, which a job within its error budget
keeps small (and a job over it stops with exit 3 anyway).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

DEFAULT_MAX_IN_MEMORY = 1_000_000


def canonical_id(value: Any) -> str | None:
    """The id as compared and seeded: strings and integers as text; None for a missing or unusable id
    (such rows are quarantined by the prompt stage with their own code, never as duplicates)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return str(value)


def _file_ids(f: Any, fmt: str, id_column: str, storage_options: dict | None) -> Iterator[str | None]:
    """Canonical ids of one input file's rows, in row order."""
    from deepinfer.pipeline.stages.read import _parse_line, filesystem

    if fmt == "parquet":
        import pyarrow.parquet as pq

        fs, path = filesystem(f.url, storage_options)
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            if id_column not in pf.schema_arrow.names:
                yield from (None for _ in range(f.num_rows))
                return
            for g in range(pf.metadata.num_row_groups):
                for value in pf.read_row_group(g, columns=[id_column]).column(0).to_pylist():
                    yield canonical_id(value)
        return
    fs, path = filesystem(f.url, storage_options)
    with fs.open(path, "rb", compression="infer") as fh:  # streamed: a file is never held whole
        index = 0
        for line in fh:
            if line.strip():
                row, _ = _parse_line(line, index)
                index += 1
                yield canonical_id(row.get(id_column)) if row is not None else None


def _positions(listing: Sequence[Any], fmt: str, id_column: str, storage_options: dict | None,
               on_bad_file: str = "fail") -> Iterator[tuple[int, int, str]]:
    """(file index, row, canonical id) for every row with a usable id, in the job's input order."""
    from deepinfer.pipeline.stages.read import _is_corrupt, bad_file_error

    for f in sorted(listing, key=lambda f: f.index):
        if getattr(f, "bad", None):  # an unreadable, quarantined file: its rows are BAD_FILE errors
            continue
        try:
            for row, rid in enumerate(_file_ids(f, fmt, id_column, storage_options)):
                if rid is not None:
                    yield f.index, row, rid
        except Exception as exc:
            if not _is_corrupt(exc):
                raise
            if on_bad_file != "quarantine":  # a corrupt page: named like any unreadable file (exit 2)
                raise bad_file_error(f.url, fmt, exc) from None
            # quarantine: the read stage turns the file's unreadable parts into BAD_FILE rows; ids read
            # before the damage still count as seen, which keeps the verdict a function of the input


def find_duplicates(listing: Sequence[Any], fmt: str, id_column: str, storage_options: dict | None = None,
                    max_in_memory: int = DEFAULT_MAX_IN_MEMORY, on_bad_file: str = "fail"
                    ) -> dict[int, list[int]]:
    """file index -> sorted row indices of the rows whose id an earlier row already has."""
    total = sum(int(f.num_rows) for f in listing)
    rows = _positions(listing, fmt, id_column, storage_options, on_bad_file)
    out: dict[int, list[int]] = {}
    if total <= max_in_memory:
        _dedupe(rows, out)
    else:
        _dedupe_partitioned(rows, -(-total // max_in_memory), out)
    return {k: sorted(v) for k, v in out.items()}


def _dedupe(rows: Iterator[tuple[int, int, str]], out: dict[int, list[int]]) -> None:
    seen: set[str] = set()
    for file_index, row, rid in rows:
        if rid in seen:
            out.setdefault(file_index, []).append(row)
        else:
            seen.add(rid)


def _bucket(rid: str, buckets: int) -> int:
    # A stable hash (not Python's salted hash()): the partitioning is then the same in every run.
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") % buckets


def _dedupe_partitioned(rows: Iterator[tuple[int, int, str]], buckets: int, out: dict[int, list[int]]
                        ) -> None:
    with tempfile.TemporaryDirectory(prefix="deepinfer-ids-") as tmp:
        paths = [os.path.join(tmp, f"{b:05d}.ids") for b in range(buckets)]
        files = [open(p, "w", encoding="utf-8") for p in paths]  # noqa: SIM115 - closed just below
        try:
            for file_index, row, rid in rows:
                # json.dumps: an id may hold tabs or newlines
                files[_bucket(rid, buckets)].write(f"{file_index}\t{row}\t{json.dumps(rid)}\n")
        finally:
            for fh in files:
                fh.close()
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                parsed = ((int(a), int(b), json.loads(c)) for a, b, c in
                          (line.rstrip("\n").split("\t", 2) for line in fh))
                _dedupe(parsed, out)


def with_duplicates(tasks: Sequence[Any], duplicates: dict[int, list[int]]) -> list[Any]:
    """The part tasks with each one's ``duplicates`` (its rows to quarantine as DUPLICATE_ID) filled in."""
    out = []
    for task in tasks:
        rows = duplicates.get(task.file_index)  # sorted (find_duplicates): bisect, not a scan per part
        if rows:
            lo = bisect.bisect_left(rows, task.first_row)
            mine = tuple(rows[lo:bisect.bisect_left(rows, task.first_row + task.num_rows, lo)])
            if mine:
                task = dataclasses.replace(task, duplicates=mine)
        out.append(task)
    return out


def mark_duplicates(spec: Any, listing: Sequence[Any], tasks: Sequence[Any]) -> list[Any]:
    """The driver's one call: the tasks of `spec`'s job with duplicate-id rows marked (unchanged when
    rows have derived ids, which are unique by construction)."""
    if spec.input.id_column is None:
        return list(tasks)
    found = find_duplicates(listing, spec.input.format, spec.input.id_column, spec.input.storage_options,
                            on_bad_file=spec.input.on_bad_file)
    return with_duplicates(tasks, found) if found else list(tasks)


# Most duplicate rows recorded in _job.json (each ~8 bytes of JSON); a job with more (past any sane error
# budget) repeats the id pass on resume instead of carrying a huge record.
MAX_RECORDED_DUPLICATES = 1_000_000


def recordable(duplicates: dict[int, list[int]]) -> bool:
    """Whether a verdict is small enough to record in _job.json (MAX_RECORDED_DUPLICATES)."""
    return sum(len(v) for v in duplicates.values()) <= MAX_RECORDED_DUPLICATES


def stored_duplicates(spec: Any) -> dict[int, list[int]] | None:
    """The duplicate-id verdict the run that started this output recorded in _job.json; None when there
    is none (no job yet, an older record, unreadable: the id pass then runs as on a first run)."""
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import JOB_FILE

    if spec.input.id_column is None:
        return None
    try:
        fs, root = storage.open_fs(spec.output.path, spec.output.storage_options)
        data = storage.read_bytes(fs, storage.join(root, JOB_FILE))
        found = json.loads(data)["duplicates"] if data is not None else None
        if not isinstance(found, dict):
            return None
        return {int(k): [int(r) for r in v] for k, v in found.items()}
    except Exception:  # noqa: BLE001 - best effort: JobStore.open reports real problems with the path
        return None
