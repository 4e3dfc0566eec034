"""Planning a Parquet job opens each input file's footer once: its row count and the kept columns' types
come from the same read (10,000-file inputs paid a second footer read per file before)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.stages import assemble, read


@pytest.fixture()
def parquet_dir(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "label": ["a", "b"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3.5], "label": ["c"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"id": [4], "other": [True]}), tmp_path / "c.parquet")
    return tmp_path


def test_listing_and_kept_types_read_each_footer_once(parquet_dir, monkeypatch):
    opened = []
    real = pq.ParquetFile

    def counting(source, *args, **kwargs):
        opened.append(getattr(source, "path", source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", counting)
    listing = read.list_input(str(parquet_dir), "parquet")
    types = assemble.keep_types_from_parquet(listing, ["id", "label", "other"])
    assert len(opened) == 3
    assert [f.num_rows for f in listing] == [2, 1, 1]
    # int64 and double unify to double; a column missing from some files keeps the others' type.
    assert types == {"id": pa.float64(), "label": pa.string(), "other": pa.bool_()}

