"""GPU: the V4 kernels on V4-Flash's shapes against their plain-torch references, and bitwise batch
invariance. Sink attention (kernels/v4_attention.py): 64 heads of 512, window 128 plus top-512 CSA entries
or the HCA entries of an 8k prompt, within bf16 tolerance; a token's output is the same alone and among 1,
7 or 64 other tokens whose key lists are longer. Lightning Indexer (kernels/v4_indexer.py): 64 heads of 128
over the 2048 entries of an 8k prompt. Run with `-m gpu` on a CUDA machine.
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.kernels import triton_available
from deepinfer.kernels.reference.v4_attention import v4_sink_attention_ref
from deepinfer.kernels.reference.v4_indexer import indexer_scores_ref

from tests.kernels.test_v4_attention_cpu import batch_of, indexer_batch_of, make_case, make_indexer_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and triton"),
]


@pytest.fixture(scope="module")
def va():
    from deepinfer.kernels import v4_attention

    return v4_attention


def _run(va, case: dict) -> torch.Tensor:
    return va.v4_sink_attention(case["q"], case["sources"], case["sinks"], case["scale"])


# (window, compressed entries): CSA (L = 640 keys), HCA over an 8k prompt (8192 / 128 entries).
LISTS = [(128, 512), (128, 64)]


@pytest.mark.parametrize("window,comp", LISTS)
def test_kernel_matches_reference_bf16_v4_shape(va, window, comp):
    case = make_case(48, 64, 512, window, comp, dtype=torch.bfloat16, seed=comp, device="cuda")
    got = _run(va, case)
    want = v4_sink_attention_ref(**case)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    # p is rounded to bf16 for p @ v (as flash attention does), then the output: a few bf16 ulps.
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,d", [(64, 512), (4, 32), (8, 64)])
def test_kernel_matches_reference_fp32(va, heads, d):
    case = make_case(24, heads, d, 128 if d == 512 else 8, 96, dtype=torch.float32, seed=d, device="cuda")
    torch.testing.assert_close(_run(va, case), v4_sink_attention_ref(**case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_token_gets_the_same_bits_alone_and_in_any_batch(va, dtype):
    case = make_case(65, 64, 512, 128, 512, dtype=dtype, seed=11, device="cuda")
    rng = random.Random(0)
    for target in (0, 17, 64):
        alone = _run(va, batch_of(case, [target], 0))[0]
        others = [i for i in range(65) if i != target]
        for n, pad in ((1, 0), (7, 40), (64, 333)):
            rows = rng.sample(others, n)
            rows.insert(rng.randrange(n + 1), target)
            got = _run(va, batch_of(case, rows, pad))[rows.index(target)]
            assert torch.equal(got, alone), (target, n, pad)


def test_cuda_ops_run_the_kernel_and_keep_gathering_for_other_cache_dtypes(va):
    from deepinfer.engine.layers.cuda_ops import CudaFastOps, CudaInvariantOps

    case = make_case(8, 64, 512, 128, 64, dtype=torch.bfloat16, seed=3, device="cuda")
    want = _run(va, case)
    for ops in (CudaInvariantOps(), CudaFastOps()):
        assert not ops.v4_gathers_keys
        assert torch.equal(ops.v4_sink_attention(case["q"], case["sources"], case["sinks"], case["scale"]),
                           want)
    q32 = case["q"].float()  # a cache dtype other than q's: the shared gathered reference
    got = CudaFastOps().v4_sink_attention(q32, case["sources"], case["sinks"], case["scale"])
    assert got.dtype == torch.float32


def _scores(case: dict) -> torch.Tensor:
    from deepinfer.kernels.v4_indexer import indexer_scores

    return indexer_scores(case["q"], case["weights"], case["rows"], case["slots"], case["valid"],
                          case["scale"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_indexer_kernel_matches_reference_v4_shape(dtype):
    case = make_indexer_case(16, 64, 128, 2048, dtype=dtype, seed=1, device="cuda")
    got, want = _scores(case), indexer_scores_ref(**case)
    assert torch.equal(got.isinf(), want.isinf())
    # bf16 products are exact in fp32; the sums differ only in order (fp32 rounding).
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_indexer_scores_of_a_token_do_not_depend_on_the_batch():
    case = make_indexer_case(65, 64, 128, 700, dtype=torch.bfloat16, seed=2, device="cuda")
    rng = random.Random(1)
    for target in (3, 40):
        alone = _scores(indexer_batch_of(case, [target], 0))[0]
        others = [i for i in range(65) if i != target]
        for n, pad in ((1, 0), (7, 64), (64, 1348)):
            rows = rng.sample(others, n)
            rows.insert(rng.randrange(n + 1), target)
            got = _scores(indexer_batch_of(case, rows, pad))[rows.index(target)]
            assert torch.equal(got[:700], alone) and (got[700:] == float("-inf")).all(), (target, n, pad)


def test_cuda_ops_run_the_indexer_kernel():
    from deepinfer.engine.layers.cuda_ops import CudaInvariantOps

    case = make_indexer_case(8, 64, 128, 256, dtype=torch.bfloat16, seed=3, device="cuda")
    ops = CudaInvariantOps()
    got = ops.v4_indexer_scores(case["q"], case["weights"], case["rows"], case["slots"], case["valid"],
                                case["scale"])
    assert torch.equal(got, _scores(case))
