"""Deterministic part planning and row identities (pipeline/parts.py)."""

from __future__ import annotations

import random

import pytest
from deepinfer.pipeline.parts import (
    PartSpec,
    make_part_id,
    parse_part_id,
    plan_parts,
    relative_input_path,
    row_id,
    total_rows,
)


@pytest.mark.parametrize(
    "listing, rows_per_part, expected",
    [
        ([("a", 10)], 4, [("00000-0000000000", "a", 0, 4), ("00000-0000000004", "a", 4, 4),
                          ("00000-0000000008", "a", 8, 2)]),
        ([("a", 4)], 4, [("00000-0000000000", "a", 0, 4)]),
        ([("a", 3)], 100, [("00000-0000000000", "a", 0, 3)]),
        ([("a", 0)], 5, []),
        # sorted by path; an empty file still takes its file index
        ([("z", 2), ("a", 0), ("m", 3)], 2, [("00001-0000000000", "m", 0, 2), ("00001-0000000002", "m", 2, 1),
                                             ("00002-0000000000", "z", 0, 2)]),
    ],
)
def test_plan_parts_cuts_sorted_files_into_fixed_size_parts(listing, rows_per_part, expected):
    parts = plan_parts(listing, rows_per_part)
    assert [(p.part_id, p.file, p.first_row, p.num_rows) for p in parts] == expected
    assert total_rows(parts) == sum(n for _, n in listing)


def test_plan_is_independent_of_listing_order_and_ids_sort_in_input_order():
    listing = [(f"s3://b/in/part-{i:03d}.parquet", (i * 37) % 50) for i in range(40)]
    plans = [plan_parts(random.Random(seed).sample(listing, len(listing)), 7) for seed in range(5)]
    assert all(p == plans[0] for p in plans)
    ids = [p.part_id for p in plans[0]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert [(p.file_index, p.first_row) for p in plans[0]] == [parse_part_id(i) for i in ids]


@pytest.mark.parametrize(
    "listing, rows_per_part, message",
    [
        ([("a", 1)], 0, "rows_per_part must be a positive integer"),
        ([("a", 1)], 2.5, "rows_per_part must be a positive integer"),
        ([("a", 1)], True, "rows_per_part must be a positive integer"),
        ([("a", -1)], 3, "row count must be a non-negative integer"),
        ([("a", 1), ("a", 2)], 3, "same file twice"),
        ([(f"f{i:06d}", 1) for i in range(100_001)], 3, "too many files"),
    ],
)
def test_plan_parts_rejects_bad_input_naming_the_problem(listing, rows_per_part, message):
    with pytest.raises(ValueError, match=message):
        plan_parts(listing, rows_per_part)


@pytest.mark.parametrize(
    "args, message",
    [(("00000-00000", "a", 0, 1), "part_id must look like"), (("00000-0000000000", "a", -1, 1), "first_row"),
     (("00000-0000000000", "a", 0, 0), "num_rows")],
)
def test_part_spec_validates_itself(args, message):
    with pytest.raises(ValueError, match=message):
        PartSpec(*args)


def test_part_spec_round_trips_through_dict():
    part = plan_parts([("x/y.jsonl", 9)], 4)[1]
    assert PartSpec.from_dict(part.to_dict()) == part and part.row_range == range(4, 8)


@pytest.mark.parametrize(
    "root, path, expected",
    [
        ("/data/in", "/data/in/a/b.parquet", "a/b.parquet"),
        ("/data/in/", "/data/in/b.parquet", "b.parquet"),
        ("bucket/in", "bucket/in/x.jsonl", "x.jsonl"),
        ("/data/in/b.parquet", "/data/in/b.parquet", "b.parquet"),  # a single-file input
        ("/elsewhere", "/data/in/b.parquet", "/data/in/b.parquet"),
    ],
)
def test_relative_input_path(root, path, expected):
    assert relative_input_path(root, path) == expected


def test_row_id_and_part_id_formats():
    assert row_id("a/b.parquet", 12) == "a/b.parquet:12"
    assert make_part_id(3, 1_000) == "00003-0000001000"
    with pytest.raises(ValueError):
        make_part_id(0, 10**10)
    with pytest.raises(ValueError, match="not a part id"):
        parse_part_id("3-1000")
