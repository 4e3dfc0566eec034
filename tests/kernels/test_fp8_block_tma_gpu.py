"""GPU (Hopper): the block-scaled FP8 GEMM with TMA tile loads (kernels/fp8_block_tma.py, K loops 0 and 1)
gives the pointer kernel's bits for the same config on the Llama-3.1-8B shapes, with ragged M / N, a K
tail and bias, one weight scale per tile (`scale_block_n`) and the persistent loop; a TMA config with
K_LOOP 2, or operands TMA cannot read, keeps pointer loads (same bits); the result matches the dequantizing
reference. The M-bucket planner (kernels/fp8_block_plan.BlockPlanner) proves the bucket table on the 8B
shapes and gives every row the reference config's bits at M = 1, 7, 64, 256, 2,048."""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
GROUP = 128


@pytest.fixture(scope="module")
def fm():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper-class GPU")
    from deepinfer.kernels import fp8_matmul

    return fp8_matmul


def _weight(n: int, k: int, seed: int):
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales

    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
    q, inv = quantize_fp8_block(w, (128, 128))
    return q, row_scales(inv, n, k, GROUP, (128, 128))


def _cfg(bm: int, bn: int, warps: int, stages: int, k_loop: int, **extra: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": GROUP, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "K_LOOP": k_loop, **extra}


CASES = [   # (M, N, K, bias, config)
    (300, 6144, 4096, False, _cfg(64, 128, 4, 3, 0)),
    (300, 4096, 14336, False, _cfg(64, 128, 4, 3, 1)),
    (2048, 28672, 4096, False, _cfg(128, 128, 8, 3, 0)),
    (64, 4096, 4096, True, _cfg(64, 64, 4, 4, 1)),
    (513, 1000, 4224, True, _cfg(128, 256, 8, 3, 0)),     # ragged M and N; K = 33 groups
    (77, 520, 4160, False, _cfg(64, 128, 4, 4, 1)),       # K % 128 == 64: a partial last group
    (300, 6144, 4096, True, _cfg(64, 32, 4, 6, 0)),        # decode-sized narrow tiles
    (2048, 28672, 4096, False, _cfg(128, 128, 8, 3, 0, PERSISTENT=1)),
    (513, 4096, 14336, False, _cfg(64, 128, 4, 3, 0, PERSISTENT=2)),
    (300, 1000, 4224, True, _cfg(64, 64, 4, 4, 0, PERSISTENT=1)),    # ragged N: a tile past the last block
]


@pytest.mark.parametrize("m,n,k,with_bias,cfg", CASES)
@pytest.mark.parametrize("scale_block_n", [0, 128])
def test_block_tma_loads_give_the_pointer_kernels_bits(fm, m, n, k, with_bias, cfg, scale_block_n):
    from deepinfer.kernels.fp8_block_tma import block_tma_launch

    w, s = _weight(n, k, seed=n + k)
    gen = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=gen) if with_bias else None
    xq, xs = fm.quantize_act(x, GROUP)
    pointer = fm.block_matmul(xq, xs, w, s, bias, torch.bfloat16, cfg)   # no "TMA": pointer loads
    tma_cfg = {**cfg, "TMA": 1}
    direct = block_tma_launch(xq, xs, w, s, bias, torch.empty_like(pointer), tma_cfg, scale_block_n)
    assert torch.equal(direct, pointer)
    assert torch.equal(fm.block_matmul(xq, xs, w, s, bias, torch.bfloat16, tma_cfg,
                                       scale_block_n=scale_block_n), pointer)
    ref = fp8_linear_ref(x.float(), w, s, None if bias is None else bias.float(), group=GROUP)
    torch.testing.assert_close(pointer.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_k_loop_2_and_unreadable_operands_keep_pointer_loads(fm):
    n, k = 512, 1024
    w, s = _weight(n, k, seed=5)
    xq, xs = fm.quantize_act(torch.randn(100, k, device=DEV, dtype=torch.bfloat16), GROUP)
    paired = _cfg(64, 128, 4, 3, 2)
    assert torch.equal(fm.block_matmul(xq, xs, w, s, None, torch.bfloat16, {**paired, "TMA": 1}),
                       fm.block_matmul(xq, xs, w, s, None, torch.bfloat16, paired))
    wide = torch.zeros(n, k + 8, device=DEV, dtype=w.dtype)      # rows of K + 8 bytes: not 16-aligned
    wide[:, :k] = w
    cfg = _cfg(64, 128, 4, 3, 0)
    assert torch.equal(fm.block_matmul(xq, xs, wide[:, :k], s, None, torch.bfloat16, {**cfg, "TMA": 1}),
                       fm.block_matmul(xq, xs, w, s, None, torch.bfloat16, cfg))


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.parametrize("layer", list(LLAMA_8B))
def test_block_buckets_proven_and_rows_invariant_across_m(fm, layer):
    from deepinfer.kernels import fp8_block_plan as bp

    n, k = LLAMA_8B[layer]
    w, s = _weight(n, k, seed=n)
    gen = torch.Generator(device=DEV).manual_seed(k)
    x = torch.randn(2048, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    planner = bp.BlockPlanner()
    full = bp.block_linear(x, w, s, planner=planner, scale_block_n=128)
    # The proof ran on the first call and the table's configs showed the reference config's bits.
    device = torch.device(DEV, torch.cuda.current_device())
    assert planner.verdicts() == {f"{n}x{k} bfloat16 {device} 128": True}
    xq, xs = fm.quantize_act(x, GROUP)
    ref_cfg = bp.parse_config(bp.REFERENCE)
    assert torch.equal(full, fm.block_matmul(xq, xs, w, s, None, torch.bfloat16, ref_cfg))
    for m in (1, 7, 64, 256):
        part = bp.block_linear(x[:m].clone(), w, s, planner=planner, scale_block_n=128)
        assert torch.equal(part, full[:m]), f"M={m}: rows differ from the same rows at M=2048"
        # Each bucket's config at this M (not only the one the planner picked) has the reference's bits.
        for _, cfg in bp.block_buckets(n, k):
            assert torch.equal(fm.block_matmul(xq[:m], xs[:m], w, s, None, torch.bfloat16, cfg,
                                               scale_block_n=128), full[:m])
    # The fast mode's bucket for M gives the same bits here too (one bitwise class on this device).
    assert torch.equal(bp.block_linear(x, w, s, invariant=False, scale_block_n=128), full)
