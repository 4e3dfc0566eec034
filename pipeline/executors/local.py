"""The in-process executor: the Ray stages, called directly, with one engine (tests and tiny jobs).

Rows flow part by part into sort windows of runtime.sort_window rows, each window is tokenized and
length-sorted, then cut into engine batches of runtime.batch_size — the same shapes Ray Data produces.
The output bytes are identical to the Ray executor's, because every row's result is independent of its
batch (batch-invariant engine, per-row seeds) and the driver orders rows before committing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.stages.plan import StagePlan, parts_table


def run_local(plan: StagePlan, parts: list[dict[str, Any]]) -> Iterator[pa.Table]:
    """Yield ENGINE_SCHEMA tables for all rows of `parts`, window by window."""
    if not parts:
        return
    read, prompt = plan.read_stage(), plan.prompt_stage()
    tokenize, engine = plan.tokenize_stage(), plan.engine_stage()
    pending: list[pa.Table] = []
    pending_rows = 0

    def flush() -> Iterator[pa.Table]:
        window = tokenize(pa.concat_tables(pending))
        for start in range(0, window.num_rows, plan.batch_size):
            yield engine(window.slice(start, plan.batch_size))

    for part in parts:
        rows = prompt(read(parts_table([part])))
        # Split at the window boundary so windows are exactly sort_window rows, as Ray Data cuts them.
        while rows.num_rows:
            take = min(rows.num_rows, plan.sort_window - pending_rows)
            pending.append(rows.slice(0, take))
            pending_rows += take
            rows = rows.slice(take)
            if pending_rows == plan.sort_window:
                yield from flush()
                pending, pending_rows = [], 0
    if pending_rows:
        yield from flush()
