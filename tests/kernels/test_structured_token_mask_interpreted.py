"""kernels/token_mask.py on CPU under Triton's interpreter, bitwise against the torch version
(kernels/reference/token_mask.py): vocabularies of one word, word tails and several blocks; all rows, some
rows in another order and no rows; rows reading the bitmask row of their own slot.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_structured_token_mask.py starts
one through tests/support/interpreted.py).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.token_mask import apply_token_bitmask_torch_

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_structured_token_mask.py")


@pytest.fixture(scope="module")
def tm():
    return interpreted_kernels("token_mask")


@pytest.mark.parametrize("s,v", [(1, 1), (3, 33), (4, 1030), (2, 2049)])
def test_triton_kernel_matches_torch(tm, s, v):
    gen = torch.Generator().manual_seed(s * 10_000 + v)
    words = (v + 31) // 32
    bm = torch.randint(-2**31, 2**31, (s, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(s, v, generator=gen)
    for rows in (None, torch.tensor([s - 1, 0]), torch.tensor([], dtype=torch.int64)):
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_torch_(a, bm, rows)
        tm.apply_token_bitmask_triton_(b, bm, rows)
        assert torch.equal(a, b), (s, v, rows)
        # per-request slots: updated row i reads bitmask row pick[i]
        n = s if rows is None else rows.numel()
        pick = torch.arange(n - 1, -1, -1) % s
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_torch_(a, bm, rows, pick)
        tm.apply_token_bitmask_triton_(b, bm, rows, pick.to(torch.int32))
        assert torch.equal(a, b), (s, v, rows, "slots")
