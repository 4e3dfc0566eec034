"""The V4 gathered sink attention and Lightning Indexer kernels on CPU under Triton's interpreter, tiny
shapes, against kernels/reference/v4_attention.py / v4_indexer.py (float32 and bfloat16), and their batch
invariance (bitwise).

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_v4_attention_cpu.py starts one).
The bf16 test patches the interpreter to multiply bf16 exactly and round casts to nearest even as the GPU
does (tests/kernels/interpreter_bf16.py).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from deepinfer.kernels.reference.v4_attention import v4_sink_attention_ref
from deepinfer.kernels.reference.v4_indexer import indexer_scores_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.kernels.test_v4_attention_cpu import batch_of, indexer_batch_of, make_case, make_indexer_case

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in a subprocess with TRITON_INTERPRET=1, started by test_v4_attention_cpu.py",
                allow_module_level=True)


@pytest.fixture(scope="module")
def va():
    pytest.importorskip("triton")
    mod = importlib.import_module("deepinfer.kernels.v4_attention")
    assert type(mod._sink_attention_kernel).__name__ == "InterpretedFunction", (
        "the kernel was compiled for a GPU, not built for the interpreter")
    return mod


def _run(va, case: dict) -> torch.Tensor:
    return va.v4_sink_attention(case["q"], case["sources"], case["sinks"], case["scale"])


# (heads, head_dim, window, compressed): one head block with padding rows; two head blocks with a ragged
# tail and key lists over several tiles (BLOCK_N = 32 in float32 below head_dim 256).
SHAPES = [(4, 32, 8, 5), (20, 64, 40, 37)]


@pytest.mark.parametrize("heads,d,window,comp", SHAPES)
def test_kernel_matches_reference_fp32(va, heads, d, window, comp):
    case = make_case(5, heads, d, window, comp, dtype=torch.float32, seed=heads)
    got = _run(va, case)
    assert got.dtype == torch.float32 and got.shape == case["q"].shape
    torch.testing.assert_close(got, v4_sink_attention_ref(**case), atol=2e-6, rtol=2e-5)


def test_kernel_with_one_source_matches_reference(va):
    case = make_case(4, 4, 32, 8, 5, dtype=torch.float32, seed=7)
    case["sources"] = case["sources"][:1]
    torch.testing.assert_close(_run(va, case), v4_sink_attention_ref(**case), atol=2e-6, rtol=2e-5)


def test_kernel_matches_reference_bf16(va, monkeypatch):
    gpu_like_bf16(monkeypatch)
    case = make_case(4, 4, 32, 8, 70, dtype=torch.bfloat16, seed=5)
    got = _run(va, case)
    assert got.dtype == torch.bfloat16
    # p is rounded to bf16 for the p @ v product, the output to bf16: a few bf16 ulps.
    torch.testing.assert_close(got.float(), v4_sink_attention_ref(**case), atol=2e-2, rtol=2e-2)


def test_a_token_gets_the_same_bits_alone_and_in_any_batch(va):
    case = make_case(6, 20, 32, 40, 37, dtype=torch.float32, seed=9)
    whole = _run(va, case)
    for t in (0, 3, 5):
        for rows, pad in (([t], 0), ([t], 50), ([5, t, 1], 13)):
            got = _run(va, batch_of(case, rows, pad))
            assert torch.equal(got[rows.index(t)], whole[t]), (t, rows, pad)


def test_kernel_rejects_unsupported_head_dim(va):
    case = make_case(2, 4, 24, 4, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim 24"):
        _run(va, case)


@pytest.fixture(scope="module")
def vi():
    pytest.importorskip("triton")
    return importlib.import_module("deepinfer.kernels.v4_indexer")


def _scores(vi, case: dict) -> torch.Tensor:
    return vi.indexer_scores(case["q"], case["weights"], case["rows"], case["slots"], case["valid"],
                             case["scale"])


# (heads, dim, entries): the tiny model's 8 x 16 (heads padded to 16); 20 heads over several entry blocks.
@pytest.mark.parametrize("heads,dim,entries", [(8, 16, 7), (20, 32, 70)])
def test_indexer_kernel_matches_reference_fp32(vi, heads, dim, entries):
    case = make_indexer_case(4, heads, dim, entries, dtype=torch.float32, seed=dim)
    got, want = _scores(vi, case), indexer_scores_ref(**case)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_indexer_kernel_matches_reference_bf16(vi, monkeypatch):
    gpu_like_bf16(monkeypatch)
    case = make_indexer_case(3, 8, 32, 40, dtype=torch.bfloat16, seed=2)
    # bf16 products are exact in fp32: only the accumulation order differs.
    torch.testing.assert_close(_scores(vi, case), indexer_scores_ref(**case), atol=1e-5, rtol=1e-5)


def test_indexer_scores_of_a_token_do_not_depend_on_the_batch(vi):
    case = make_indexer_case(5, 20, 32, 70, dtype=torch.float32, seed=8)
    whole = _scores(vi, case)
    for t in (1, 4):
        for rows, pad in (([t], 0), ([t], 90), ([3, t], 5)):
            got = _scores(vi, indexer_batch_of(case, rows, pad))[rows.index(t)]
            assert torch.equal(got[:70], whole[t]) and (got[70:] == float("-inf")).all(), (t, rows, pad)
