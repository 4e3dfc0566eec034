"""A prepared part as one row: how a part crosses from the prepare stage to an engine actor on Ray.

Ray Data refuses `batch_size=None` (a batch = one whole block) for a stage that asks for GPUs, and with an
integer batch size it slices or bundles blocks to that many rows, so a part of many rows could reach an
engine split over calls or merged with another part, and be committed out of its unit. A prepared part
therefore travels packed into a single row (its rows as one Arrow IPC stream in a binary column) and the
engine stage maps with batch_size=1: every engine call is exactly one whole part, on CPU and GPU clusters
alike, whatever Ray Data does with blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

PACKED_COLUMN = "__packed_part"
PACKED_SCHEMA = pa.schema([pa.field(PACKED_COLUMN, pa.large_binary(), nullable=False)])


def pack_parts(tables: Iterable[pa.Table]) -> pa.Table:
    """One PACKED_SCHEMA row per table (a table is one prepared part)."""
    blobs = []
    for table in tables:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        blobs.append(sink.getvalue().to_pybytes())
    return pa.table({PACKED_COLUMN: pa.array(blobs, pa.large_binary())}, schema=PACKED_SCHEMA)


def unpack_parts(batch: pa.Table, empty: pa.Schema) -> pa.Table:
    """The rows of every part packed in `batch` (one as a rule), in order; `empty`'s schema if none."""
    if batch.schema.names != [PACKED_COLUMN]:
        raise ValueError(f"expected packed parts (one {PACKED_COLUMN!r} column), "
                         f"got columns {batch.schema.names}")
    tables = [pa.ipc.open_stream(pa.py_buffer(blob.as_py())).read_all() for blob in batch.column(0)]
    return pa.concat_tables(tables) if tables else empty.empty_table()
