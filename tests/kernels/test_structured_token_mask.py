"""apply_token_bitmask_: the torch version against a naive loop, the Triton kernel against torch."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.masking import apply_token_bitmask_
from deepinfer.kernels.reference.token_mask import apply_token_bitmask_torch_, unpack_bitmask

from tests.support.interpreted import launches, run_interpreted

SHAPES = [(1, 1), (3, 31), (2, 32), (4, 33), (5, 100), (3, 1030)]


def _random_case(s: int, v: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    words = (v + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (s, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(s, v, generator=gen).to(dtype)
    return logits, bitmask


def _naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]) if rows is None else rows:
        for v in range(logits.shape[1]):
            word = int(bitmask[r, v // 32]) & 0xFFFFFFFF
            if not (word >> (v % 32)) & 1:
                out[r, v] = float("-inf")
    return out


@pytest.mark.parametrize("s,v", SHAPES)
@pytest.mark.parametrize("with_rows", [False, True])
def test_torch_version_matches_naive_loop(s, v, with_rows):
    logits, bitmask = _random_case(s, v, seed=s * 1000 + v)
    rows = [s - 1, 0] if with_rows else None
    expected = _naive(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_torch_(got, bitmask, None if rows is None else torch.tensor(rows))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_version_keeps_dtype_and_allowed_values(dtype):
    logits, bitmask = _random_case(3, 70, seed=1, dtype=dtype)
    got = logits.clone()
    apply_token_bitmask_(got, bitmask)
    allowed = unpack_bitmask(bitmask, 70)
    assert got.dtype == dtype
    assert torch.equal(got[allowed], logits[allowed])
    assert torch.isneginf(got[~allowed]).all()


def test_rows_outside_row_indices_are_untouched():
    logits, bitmask = _random_case(4, 64, seed=2)
    bitmask[:] = 0  # everything disallowed
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, torch.tensor([1, 3]))
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert torch.isneginf(got[[1, 3]]).all()


def test_all_ones_row_masks_nothing_and_bits_past_vocab_are_ignored():
    logits, _ = _random_case(2, 40, seed=3)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[1, 1] = 0xFF  # tokens 32..39 allowed, bits 40..63 (past V) clear
    got = logits.clone()
    apply_token_bitmask_(got, bitmask)
    assert torch.equal(got, logits)


@pytest.mark.parametrize("s,v", [(3, 31), (4, 33), (5, 100), (3, 1030)])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference_with_bitmask_rows(s, v, with_rows, dtype):
    """The engine's CPU path (numpy unpack) equals the reference, with and without a slot indirection."""
    logits, slots = _random_case(s + 3, v, seed=7 * s + v, dtype=dtype)   # more slots than logits rows
    logits = logits[:s]
    rows = torch.tensor([s - 1, 0]) if with_rows else None
    pick = torch.tensor([s + 2, 1]) if with_rows else torch.arange(s + 2, -1, -1)[:s]
    expected, got = logits.clone(), logits.clone()
    apply_token_bitmask_torch_(expected, slots, rows, pick)
    apply_token_bitmask_(got, slots, rows, pick)
    assert torch.equal(got, expected)
    # The indirection means exactly "gather the slot rows first".
    gathered = torch.zeros(s, slots.shape[1], dtype=torch.int32)
    gathered[rows if rows is not None else torch.arange(s)] = slots[pick]
    naive = _naive(logits, gathered, None if rows is None else rows.tolist())
    assert torch.equal(got.float(), naive.float())


def test_cpu_path_on_a_column_slice_of_padded_logits():
    wide, bitmask = _random_case(3, 96, seed=11)
    bitmask = bitmask[:, :2].contiguous()
    for rows in (None, torch.tensor([2])):
        a, b = wide.clone(), wide.clone()
        apply_token_bitmask_(a[:, :64], bitmask, rows)
        apply_token_bitmask_torch_(b[:, :64], bitmask, rows)
        assert torch.equal(a, b) and torch.equal(a[:, 64:], wide[:, 64:])


@pytest.mark.parametrize(
    "logits,bitmask,rows,message",
    [
        (torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.int32), None, "bitmask: shape"),
        (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), None, "bitmask: shape"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None, "bitmask: dtype"),
        (torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), None, "logits: dtype"),
        (torch.zeros(64), torch.zeros(2, dtype=torch.int32), None, "logits: expected 2 dimensions"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([2]), "row_indices"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0.0]), "row_indices: dtype"),
    ],
)
def test_wrapper_rejects_bad_arguments(logits, bitmask, rows, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_(logits, bitmask, rows)


@pytest.mark.parametrize(
    "bitmask,rows,pick,message",
    [
        (torch.zeros(5, 3, dtype=torch.int32), None, torch.tensor([0, 1]), "words per row"),
        (torch.zeros(5, 2, dtype=torch.int32), None, torch.tensor([0]), "bitmask_rows: 1 entries"),
        (torch.zeros(5, 2, dtype=torch.int32), torch.tensor([1]), torch.tensor([5]), "bitmask_rows: values"),
    ],
)
def test_wrapper_rejects_bad_bitmask_rows(bitmask, rows, pick, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_(torch.zeros(2, 64), bitmask, rows, pick)


@launches("tests/kernels/test_structured_token_mask_interpreted.py")
def test_triton_kernel_matches_torch_under_interpreter(request):
    # TRITON_INTERPRET is read when a kernel is decorated, so the check runs in a fresh interpreter.
    run_interpreted(request, "token-mask kernel", allow_skips=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,v", [(1, 32000), (64, 128256), (7, 151936)])
def test_triton_kernel_matches_torch_on_cuda(s, v, dtype):
    logits, bitmask = _random_case(s, v, seed=v, dtype=dtype)
    rows = torch.arange(0, s, 2)
    for r in (None, rows):
        expected = logits.clone()
        apply_token_bitmask_torch_(expected, bitmask, r)
        got = logits.cuda()
        from deepinfer.kernels.token_mask import apply_token_bitmask_triton_

        apply_token_bitmask_triton_(got, bitmask.cuda(), None if r is None else r.cuda())
        assert torch.equal(got.cpu(), expected)
