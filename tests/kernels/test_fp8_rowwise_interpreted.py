"""Rowwise FP8 GEMM, the block GEMM's second K loop and the FP8 MoE under Triton's interpreter (a
subprocess with TRITON_INTERPRET=1, started by tests/kernels/test_fp8_rowwise_cpu.py), tiny shapes,
against kernels/reference/fp8_matmul.py and kernels/reference/fp8_moe.py."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from deepinfer.kernels.reference.fp8_matmul import (
    fp8_grouped_linear_ref,
    fp8_linear_ref,
    fp8_rowwise_linear_ref,
    quantize_act_ref,
)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in a subprocess with TRITON_INTERPRET=1, started by "
                "tests/kernels/test_fp8_rowwise_cpu.py", allow_module_level=True)

GROUP = 32
TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def rw():
    pytest.importorskip("triton")
    mod = importlib.import_module("deepinfer.kernels.fp8_rowwise")
    assert type(mod._rowwise_gemm_kernel).__name__ == "InterpretedFunction"
    return mod


def _weight(n: int, k: int, seed: int, cols: int, experts: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    w = (torch.randn(*shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*shape[:-1], cols, generator=gen) * 1e-3 + 1e-4
    return w, s


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0  # an all-zero row: scale EPS / 448, quantizes to zeros
    return x


# Small configs so the interpreter covers several tiles along M, N and K (and a K tail).
_SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2,
          "IMPRECISE_ACC": 0}


@pytest.mark.parametrize("m,k", [(1, 40), (7, 1100), (18, 64), (300, 48)])   # 300: 32 rows per program
def test_quantize_rows_bitwise_reference(rw, m, k):
    x = _x(m, k, seed=k)
    q, s = rw.quantize_rows(x)
    q_ref, s_ref = quantize_act_ref(x, k)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m,n,k,bias,config", [(1, 48, 64, False, None), (37, 40, 80, True, _SMALL),
                                                (20, 24, 96, False, {**_SMALL, "IMPRECISE_ACC": 32})])
def test_rowwise_linear_matches_reference(rw, m, n, k, bias, config):
    w, s = _weight(n, k, seed=n, cols=1)
    x = _x(m, k, seed=m)
    b = torch.randn(n) if bias else None
    out = rw.fp8_rowwise_linear(x, w, s, b, config=config)
    torch.testing.assert_close(out, fp8_rowwise_linear_ref(x, w, s, b), **TIGHT)
    with pytest.raises(ValueError, match="one scale per output channel"):
        rw.fp8_rowwise_linear(x, w, s.expand(n, 2).contiguous())


@pytest.mark.parametrize("config", [None, _SMALL])
def test_rowwise_rows_do_not_depend_on_batch(rw, config):
    # The interpreter's tl.dot is numpy's matmul, whose per-element rounding depends on the row's position
    # in the tile (a SIMD artifact the GPU does not have: tests/kernels/test_fp8_gpu.py checks any row
    # placement there), so here every row keeps its position modulo the tile height (64 and 16).
    w, s = _weight(40, 64, seed=1, cols=1)
    x = _x(80, 64, seed=2)
    full = rw.fp8_rowwise_linear(x, w, s, invariant=True, config=config)
    for lo, hi in ((0, 1), (0, 33), (64, 80)):
        part = rw.fp8_rowwise_linear(x[lo:hi].clone(), w, s, invariant=True, config=config)
        assert torch.equal(part, full[lo:hi]), (lo, hi)
    # A row among other rows of another batch: the same bits.
    other = _x(12, 64, seed=3)
    mixed = torch.cat([other[:7], x[7:8], other[7:]])
    assert torch.equal(rw.fp8_rowwise_linear(mixed, w, s, config=config)[7], full[7])


def test_block_k_loops_match_reference_and_lagged_is_default_bitwise():
    from deepinfer.kernels import fp8_matmul as fm

    w, s = _weight(40, 112, seed=4, cols=-(-112 // GROUP))
    x = _x(21, 112, seed=5)
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
    default = fm.fp8_linear(x, w, s, group=GROUP, config={**base, "K_LOOP": 0})
    lagged = fm.fp8_linear(x, w, s, group=GROUP, config={**base, "K_LOOP": 1})
    torch.testing.assert_close(lagged, fp8_linear_ref(x, w, s, group=GROUP), **TIGHT)
    assert torch.equal(lagged, default)
    alone = fm.fp8_linear(x[:5].clone(), w, s, group=GROUP, config={**base, "K_LOOP": 1})
    assert torch.equal(alone, lagged[:5])   # same in-tile positions: see the rowwise invariance test
    # K_LOOP=2 (two partial accumulators; K = 112 is 3.5 steps: an odd step count and a K tail).
    paired = fm.fp8_linear(x, w, s, group=GROUP, config={**base, "K_LOOP": 2})
    torch.testing.assert_close(paired, fp8_linear_ref(x, w, s, group=GROUP), **TIGHT)
    assert torch.equal(fm.fp8_linear(x[:5].clone(), w, s, group=GROUP, config={**base, "K_LOOP": 2}),
                       paired[:5])
    # One K step only (K <= group): the loop body never runs.
    w1, s1 = _weight(16, 32, seed=6, cols=1)
    x1 = _x(3, 32, seed=7)
    torch.testing.assert_close(fm.fp8_linear(x1, w1, s1, group=GROUP, config={**base, "K_LOOP": 1}),
                               fp8_linear_ref(x1, w1, s1, group=GROUP), **TIGHT)


@pytest.mark.parametrize("k_loop", [1, 2])
def test_grouped_k_loops_match_reference(k_loop):
    from deepinfer.kernels import fp8_matmul as fm

    w, s = _weight(24, 96, seed=8, cols=3, experts=3)
    offsets = torch.tensor([0, 6, 6, 19])
    x = _x(19, 96, seed=9)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2, "K_LOOP": k_loop}
    out = fm.fp8_grouped_linear(x, w, s, offsets, group=GROUP, config=cfg)
    torch.testing.assert_close(out, fp8_grouped_linear_ref(x, w, s, offsets, GROUP), **TIGHT)
