"""Gathering a part's result rows on the driver until the last of them is back (runner.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.parts import PartTask


class PartCollector:
    """Gathers result rows per part; returns (part, rows) the moment the last distinct row of a part is back.

    Executors deliver a part in one table as a rule (one Ray Data block per part), so this holds rows only
    when a block was split. Rows are keyed by input position, so a row delivered twice (a retried task) is
    kept once, and rows of an already completed part are ignored.
    """

    def __init__(self, parts: Sequence[PartTask]) -> None:
        self.parts = {p.part_id: p for p in parts}
        self.rows: dict[str, list[pa.Table]] = {}
        self.seen: dict[str, set[int]] = {}
        self.done: set[str] = set()

    def add(self, batch: pa.Table) -> list[tuple[PartTask, pa.Table]]:
        complete = []
        ids = batch.column("__part")
        present = pc.unique(ids).to_pylist()
        for part_id in sorted(present):
            if part_id in self.done:
                continue
            # the rule is one part per block: take it whole rather than copying it through a filter
            rows = batch if len(present) == 1 else batch.filter(pc.equal(ids, part_id))
            self.rows.setdefault(part_id, []).append(rows)
            self.seen.setdefault(part_id, set()).update(rows.column("__row").to_pylist())
            part = self.parts[part_id]
            if len(self.seen[part_id]) == part.num_rows:
                table = pa.concat_tables(self.rows.pop(part_id))
                if table.num_rows != part.num_rows:
                    table = _dedupe_rows(table)
                del self.seen[part_id]
                self.done.add(part_id)
                complete.append((part, table))
        return complete

    def pending(self) -> list[str]:
        return sorted(self.rows)


def _dedupe_rows(table: pa.Table) -> pa.Table:
    rows = table.column("__row").to_pylist()
    first: dict[int, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(r, i)
    return table.take(pa.array(sorted(first.values()), type=pa.int64()))
