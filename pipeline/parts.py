"""Deterministic division of a job's input into parts, and row identities.

A part is the unit of work and of commit: a contiguous run of rows of one input file. The plan depends only
on the input listing (paths and row counts) and ``rows_per_part``, never on timing or the number of engines,
so every run of a job — first, resumed, or racing — computes the same part ids:

* the listing is sorted by path; ``file_index`` is the position in that sorted listing (empty files included);
* each file is cut into ``ceil(num_rows / rows_per_part)`` parts; part ``k`` covers rows
  ``[k * rows_per_part, min((k + 1) * rows_per_part, num_rows))``;
* ``part_id = f"{file_index:05d}-{first_row:010d}"`` — fixed width, so lexical order is input order.

A row's identity is its ``id_column`` value when the spec names one, else ``f"{relative_path}:{row_index}"``
(:func:`row_id`), where ``relative_path`` is the file's path relative to the input root (so that moving the
input tree does not change ids, seeds or outputs).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields

import pyarrow as pa

PART_ID_RE = re.compile(r"^(\d{5})-(\d{10})$")
PART_ID_LEN = 16
MAX_FILES = 100_000
MAX_ROWS_PER_FILE = 10**10


@dataclass(frozen=True)
class PartSpec:
    """One unit of work/commit: ``num_rows`` rows of ``file`` starting at row ``first_row``."""

    part_id: str
    file: str
    first_row: int
    num_rows: int

    def __post_init__(self) -> None:
        if not PART_ID_RE.match(self.part_id):
            raise ValueError(f"part_id must look like '00000-0000000000', got {self.part_id!r}")
        if self.first_row < 0 or self.num_rows < 1:
            raise ValueError(f"part {self.part_id}: first_row must be >= 0 and num_rows >= 1")

    @property
    def file_index(self) -> int:
        """Position of ``file`` in the sorted input listing."""
        return int(self.part_id[:5])

    @property
    def row_range(self) -> range:
        """Row indices (within ``file``) covered by this part."""
        return range(self.first_row, self.first_row + self.num_rows)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PartSpec:
        return cls(d["part_id"], d["file"], int(d["first_row"]), int(d["num_rows"]))


@dataclass(frozen=True)
class PartTask:
    """What a worker needs to read one part: the planned part joined with its input file's listing entry.

    Tasks travel between the driver and the Ray workers as rows of :data:`PART_TASK_SCHEMA` (one typed
    Arrow column per field, declared once here), never as free-form JSON.
    """

    part_id: str
    file_index: int
    url: str
    relpath: str
    first_row: int
    num_rows: int
    offset: int | None = None  # byte offset of first_row in an uncompressed JSONL file, when listed
    # Rows (file row indices) whose id an earlier row of the job has: quarantined as DUPLICATE_ID
    # (stages/dedupe.py decides them on the driver; the read stage marks them).
    duplicates: tuple[int, ...] = ()

    def as_mapping(self) -> dict:
        """The plain mapping the read stage takes (stages/prompt.read_part_table)."""
        return asdict(self)


PART_TASK_SCHEMA = pa.schema([
    ("part_id", pa.string()), ("file_index", pa.int32()), ("url", pa.string()), ("relpath", pa.string()),
    ("first_row", pa.int64()), ("num_rows", pa.int64()), ("offset", pa.int64()),
    ("duplicates", pa.list_(pa.int64())),
])


def tasks_table(tasks: Sequence[PartTask]) -> pa.Table:
    """Part tasks as a :data:`PART_TASK_SCHEMA` table (the Ray Data input: one row per part)."""
    names = [f.name for f in fields(PartTask)]
    return pa.Table.from_pydict({n: [getattr(t, n) for t in tasks] for n in names}, schema=PART_TASK_SCHEMA)


def tasks_from_table(table: pa.Table) -> list[PartTask]:
    """Inverse of :func:`tasks_table`."""
    return [PartTask(**{**row, "duplicates": tuple(row["duplicates"] or ())})
            for row in table.select(PART_TASK_SCHEMA.names).to_pylist()]


def make_part_id(file_index: int, first_row: int) -> str:
    """``"{file_index:05d}-{first_row:010d}"``; ValueError when either does not fit its width."""
    if not 0 <= file_index < MAX_FILES:
        raise ValueError(f"input has too many files: file index {file_index} (at most {MAX_FILES} files)")
    if not 0 <= first_row < MAX_ROWS_PER_FILE:
        raise ValueError(f"row index {first_row} out of range (at most {MAX_ROWS_PER_FILE} rows per file)")
    return f"{file_index:05d}-{first_row:010d}"


def parse_part_id(part_id: str) -> tuple[int, int]:
    """``(file_index, first_row)`` of a part id; ValueError when it is not one."""
    m = PART_ID_RE.match(part_id)
    if not m:
        raise ValueError(f"not a part id: {part_id!r}")
    return int(m.group(1)), int(m.group(2))


def is_part_id(text: str) -> bool:
    return bool(PART_ID_RE.match(text))


def plan_parts(listing: Iterable[tuple[str, int]], rows_per_part: int) -> list[PartSpec]:
    """Cut the input into parts. ``listing`` is ``[(path, num_rows), ...]`` in any order.

    Returns the parts in input order (= part id order). Raises ValueError for a non-positive
    ``rows_per_part``, a negative row count, or a path listed twice.
    """
    if isinstance(rows_per_part, bool) or not isinstance(rows_per_part, int) or rows_per_part < 1:
        raise ValueError(f"runtime.rows_per_part must be a positive integer, got {rows_per_part!r}")
    items = [(str(path), num_rows) for path, num_rows in listing]
    if len(items) > MAX_FILES:
        raise ValueError(f"input has too many files: {len(items)} (at most {MAX_FILES} files)")
    paths = [p for p, _ in items]
    if len(set(paths)) != len(paths):
        dup = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"input listing names the same file twice: {dup[:3]}")
    parts: list[PartSpec] = []
    for file_index, (path, num_rows) in enumerate(sorted(items)):
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
            raise ValueError(f"input file {path}: row count must be a non-negative integer, got {num_rows!r}")
        for first in range(0, num_rows, rows_per_part):
            parts.append(
                PartSpec(
                    part_id=make_part_id(file_index, first),
                    file=path,
                    first_row=first,
                    num_rows=min(rows_per_part, num_rows - first),
                )
            )
    return parts


def relative_input_path(input_root: str, path: str) -> str:
    """``path`` relative to the input root, '/'-separated (the file part of a default row id)."""
    root = input_root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path.rsplit("/", 1)[-1] if root and path == root else path


def row_id(relative_path: str, row_index: int) -> str:
    """Default identity of a row when the spec has no id_column: ``"{relative_path}:{row_index}"``."""
    return f"{relative_path}:{row_index}"


def total_rows(parts: Sequence[PartSpec]) -> int:
    return sum(p.num_rows for p in parts)
