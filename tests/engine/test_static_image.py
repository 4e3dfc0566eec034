"""A CUDA graph's integer inputs packed in one tensor (runner/static_image.py): the layout (int64 fields at
8-byte aligned offsets, views sharing the image), and which word ranges an upload of field prefixes
copies. The copy itself through the pinned ring: tests/engine/test_graph_buckets.py (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.engine.runner.static_image import StaticImage

FIELDS = [("a", (3,), np.int32), ("b", (4,), np.int64), ("t", (5, 2), np.int32), ("c", (2,), np.int64)]


def test_fields_are_aligned_views_of_one_image():
    img = StaticImage(FIELDS, torch.device("cpu"))
    # a: words 0-2, b: 4-11 (one padding word), t: 12-21, c: 22-25
    assert img._spans == {"a": (0, 3), "b": (4, 12), "t": (12, 22), "c": (22, 26)}
    img.host["b"][:] = [1, -2, 2**40, 7]
    img.host["t"][4] = [8, 9]
    assert img.device["b"].tolist() == [1, -2, 2**40, 7] and img.device["b"].dtype == torch.int64
    assert img.device["t"][4].tolist() == [8, 9] and img.nbytes == 26 * 4


@pytest.mark.parametrize("parts,expected", [
    (None, [(0, 26)]),
    ({"a": 3, "b": 4}, [(0, 3), (4, 12)]),                 # the alignment word is not copied
    ({"b": 4, "t": 5, "c": 2}, [(4, 26)]),                   # whole adjacent fields: one copy
    ({"t": 2, "c": 1}, [(12, 16), (22, 24)]),                # prefixes: rows of a 2-D field
    ({"c": 1, "b": 2}, [(4, 8), (22, 24)]),                  # in image order whatever the order given
    ({"a": 0, "t": 9}, [(12, 22)]),                          # nothing of a; clamped to t's rows
])
def test_upload_copies_the_prefixes_asked_for(parts, expected):
    assert StaticImage(FIELDS, torch.device("cpu"))._ranges(parts) == expected
