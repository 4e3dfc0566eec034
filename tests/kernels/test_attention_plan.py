"""The paged-attention program plan (kernels/paged_attention.build_plan): every (sequence, query block) pair
exactly once, heaviest first (the largest last position a block attends to), ties by sequence then block —
checked against a plain sort of the pairs on a table of batch shapes and random ones."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from deepinfer.kernels.paged_attention import build_plan  # noqa: E402


def _plan_by_sorting(query_lens: list[int], seq_lens: list[int], block_q: int) -> list[int]:
    work = []
    for seq, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for qb in range(-(-q_len // block_q)):
            work.append((-(s_len - q_len + min((qb + 1) * block_q, q_len)), seq, qb))
    return [x for _, seq, qb in sorted(work) for x in (seq, qb)]


CASES = [   # (query_lens, seq_lens, block_q)
    ([512] * 32, [512] * 32, 9),                    # a prefill step of equal prompts: ties everywhere
    ([1] * 6, [40, 7, 7, 300, 1, 40], 4),           # decodes: one block each, equal lengths tie by sequence
    ([5, 1, 300, 17], [5, 90, 1024, 17], 16),       # mixed: a chunk late in a long prompt first
    ([0, 3], [10, 3], 2),                           # a sequence with no new tokens has no block
    ([], [], 8),
]


@pytest.mark.parametrize("query_lens,seq_lens,block_q", CASES)
def test_plan_orders_blocks_heaviest_first(query_lens, seq_lens, block_q):
    got = build_plan(query_lens, seq_lens, block_q)
    assert got.dtype.name == "int32"
    assert got.tolist() == _plan_by_sorting(query_lens, seq_lens, block_q)


def test_plan_matches_the_sort_on_random_batches():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        q = [rng.choice([1, 1, rng.randint(1, 700)]) for _ in range(n)]
        s = [qi + rng.randint(0, 2000) for qi in q]
        bq = rng.choice([1, 2, 4, 9, 16, 64])
        assert build_plan(q, s, bq).tolist() == _plan_by_sorting(q, s, bq)


def test_plan_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        build_plan([1, 2], [3], 4)
