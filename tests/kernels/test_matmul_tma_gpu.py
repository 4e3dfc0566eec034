"""GPU (Hopper, bf16): the GEMM with TMA tile loads (MatmulConfig.tma, kernels/matmul_tma.py) gives the same
bits as the pointer-load kernel with the same tile config, for every row count, with bias, ragged M/N and
a K that is not a multiple of BLOCK_K; operands TMA cannot read (a strided view), and float32 operands (the
TMA kernel has no IEEE dot), fall back to the pointer kernel and still give the same bits; the result
matches the float32 reference.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from deepinfer.kernels.reference.matmul import bi_linear_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
CASES = [   # (M, N, K, bias, config (block_m, block_n, warps, stages, persistent))
    (256, 4096, 4096, False, (64, 128, 4, 5, False)),
    (200, 1152, 896, True, (64, 64, 4, 6, False)),
    (1000, 6144, 4096, False, (128, 256, 8, 3, True)),
    (37, 896, 4864, False, (64, 32, 4, 6, False)),
    (513, 1000, 200, True, (128, 128, 8, 4, True)),    # ragged N and K % 64 != 0
]


@pytest.fixture(scope="module")
def mm():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper-class GPU")
    from deepinfer.kernels import matmul

    return matmul


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(BF16)


@pytest.mark.parametrize(("m", "n", "k", "has_bias", "tile"), CASES)
def test_tma_loads_give_the_pointer_kernels_bits(mm, m, n, k, has_bias, tile):
    bm, bn, warps, stages, persistent = tile
    cfg = mm.MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=warps, num_stages=stages,
                          persistent=persistent)
    tma_cfg = dataclasses.replace(cfg, tma=True)
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2, scale=k ** -0.5)
    b = _randn(n, seed=3) if has_bias else None
    ref = mm.bi_linear(x, w, b, config=cfg)
    out = mm.bi_linear(x, w, b, config=tma_cfg)
    assert torch.equal(out, ref)
    for rows in (1, 7, min(64, m)):
        assert torch.equal(mm.bi_linear(x[:rows].clone(), w, b, config=tma_cfg), ref[:rows])
    torch.testing.assert_close(out.float(), bi_linear_ref(x.float(), w.float(),
                                                          None if b is None else b.float()),
                               atol=2e-2, rtol=2e-2)


def test_operands_tma_cannot_read_fall_back_with_the_same_bits(mm):
    cfg = mm.MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, tma=True)
    wide = _randn(64, 2 * 512 + 8, seed=4)
    x = wide[:, 4:4 + 512]            # 8-byte offset base: not TMA-aligned
    w = _randn(256, 512, seed=5)
    from deepinfer.kernels.matmul_tma import tma_usable

    assert not tma_usable(x, w)
    expected = mm.bi_linear(x.contiguous(), w, config=dataclasses.replace(cfg, tma=False))
    assert torch.equal(mm.bi_linear(x, w, config=cfg), expected)


def test_float32_operands_keep_ieee_dots_under_a_tma_config(mm):
    # The TMA kernel's dots would run in TF32: float32 operands must take the pointer kernel's IEEE dots.
    cfg = mm.MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, tma=True)
    x, w = _randn(96, 512, seed=6).float(), _randn(192, 512, seed=7).float()
    out = mm.bi_linear(x, w, config=cfg)
    assert torch.equal(out, mm.bi_linear(x, w, config=dataclasses.replace(cfg, tma=False)))
    torch.testing.assert_close(out, (x.double() @ w.double().T).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(9728, 896), (28672, 4096)])    # Qwen2.5-0.5B and Llama-3.1-8B gate_up
@pytest.mark.parametrize("m", [1, 7, 64, 256, 3000, 16384])
def test_swiglu_epilogue_equals_gemm_then_silu_and_mul(mm, m, n, k):
    """The SWIGLU epilogue over the rows reordered gate j, up j gives silu_and_mul of the plain GEMM bit for
    bit, with the planner's config for that M (the engine's deterministic gate_up)."""
    from deepinfer.engine.models.quant.fp8_tensor import interleave_halves
    from deepinfer.kernels.activation import silu_and_mul

    gen = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, generator=gen).to(BF16)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(BF16)
    planner = mm.MatmulPlanner()
    want = silu_and_mul(mm.bi_linear(x, w, planner=planner))
    got = mm.bi_linear(x, interleave_halves(w), planner=planner, swiglu=True)
    assert torch.equal(got, want)


SPLIT_FORMS = [   # (block_m, block_n, warps, stages, persistent, serial, tma): one split count, many forms
    (64, 64, 4, 4, False, False, False),     # the reference: parallel form, pointer loads
    (64, 32, 4, 6, False, False, True),      # parallel, TMA (decode-sized M)
    (128, 64, 4, 4, False, False, True),
    (128, 128, 8, 4, True, True, True),      # serial, TMA, persistent (prefill-sized M)
    (128, 256, 8, 3, True, True, True),
    (64, 64, 4, 4, False, True, False),      # serial, pointer loads
]


@pytest.mark.parametrize("n,k,split", [(896, 4864, 4), (4096, 14336, 2), (4096, 4096, 2), (1000, 200, 3)])
def test_split_k_forms_and_loaders_give_the_same_bits_at_every_m(mm, n, k, split):
    """Every form of one fixed-order split-K (parallel or serial, TMA or pointer loads, any tile) gives the
    same bits, row by row, at decode- and prefill-sized M: what lets M buckets mix them."""
    x_all, w = _randn(4096, k, seed=8), _randn(n, k, seed=9, scale=k ** -0.5)
    b = _randn(n, seed=10) if n == 1000 else None
    ref = None
    for bm, bn, warps, stages, persistent, serial, tma in SPLIT_FORMS:
        cfg = mm.MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=warps, num_stages=stages,
                              persistent=persistent, split_k=split, serial_split=serial, tma=tma)
        full = mm.bi_linear(x_all, w, b, config=cfg)
        ref = full if ref is None else ref
        assert torch.equal(full, ref), cfg
        for rows in (1, 7, 256):
            part = mm.bi_linear(x_all[5:5 + rows].clone(), w, b, config=cfg)
            assert torch.equal(part, ref[5:5 + rows]), cfg
    torch.testing.assert_close(ref.float(), bi_linear_ref(x_all.float(), w.float(),
                                                          None if b is None else b.float()),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("m", "n", "k", "has_bias", "swiglu"), [
    (4100, 1152, 896, True, False),      # 0.5B qkv, ragged M
    (2048, 9728, 896, False, True),      # 0.5B gate_up with the SWIGLU epilogue
    (1000, 6144, 4096, False, False),    # 8B qkv
    (513, 1000, 200, True, False),       # ragged N and K % 64 != 0
])
def test_flattened_tile_loop_gives_the_same_bits(mm, m, n, k, has_bias, swiglu):
    """MatmulConfig.flatten (the persistent tile loop pipelined with the K loop) only reorders loads:
    bitwise the unflattened kernel, at every row count."""
    cfg = mm.MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True,
                          tma=True)
    flat = dataclasses.replace(cfg, flatten=True)
    x, w = _randn(m, k, seed=4), _randn(n, k, seed=5, scale=k ** -0.5)
    b = _randn(n, seed=6) if has_bias else None
    ref = mm.bi_linear(x, w, b, config=cfg, swiglu=swiglu)
    assert torch.equal(mm.bi_linear(x, w, b, config=flat, swiglu=swiglu), ref)
    for rows in (1, 7, 300):
        assert torch.equal(mm.bi_linear(x[:rows].clone(), w, b, config=flat, swiglu=swiglu), ref[:rows])


def test_flatten_needs_one_persistent_tma_loop(mm):
    with pytest.raises(ValueError, match="flatten"):
        mm.MatmulConfig(block_m=128, block_n=256, block_k=64, persistent=False, tma=True, flatten=True)
    with pytest.raises(ValueError, match="flatten"):
        mm.MatmulConfig(block_m=128, block_n=256, block_k=64, tma=True, split_k=2, serial_split=True,
                        flatten=True)
