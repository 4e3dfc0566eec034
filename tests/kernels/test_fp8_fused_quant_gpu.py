"""The row quantizer and the fused RMSNorm / SiLU-and-mul -> FP8 kernels on a real GPU (`-m gpu`, sm89+),
real bf16 at the Llama-3.1-8B widths: bitwise the unfused kernels (rmsnorm.rms_norm / activation.
silu_and_mul, then quantize_rows) and `quantize_act_ref`, every launch path, and CUDA-graph capture. The
per-token-group forms (kernels/fp8_group_quant.py, `group=128`: the block-scaled GEMM's input) likewise
against rms_norm / silu_and_mul then `quantize_act(., 128)`."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fp8_fused_quant import quantize_rows_ref

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_ok(), reason="needs an FP8 GPU (compute capability >= 8.9)")


def _same(got, want) -> None:
    assert torch.equal(got[1], want[1]), "scales differ"
    bad = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()
    assert int(bad) == 0, f"{int(bad)} e4m3 codes differ"


def _rows(m: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(m, k, device=CUDA, generator=gen) * scale
    x[0] = 0.0
    if m > 2:
        x[1, ::7] = 3e4                         # large values: the scale's range edge
        x[2] *= 1e-3
    return x.to(torch.bfloat16)


@needs_fp8
@pytest.mark.parametrize("m,k,chunk", [(1, 4096, None), (37, 14336, None), (256, 14336, None),
                                       (2048, 4096, None), (300, 18944, None), (5, 40000, None),
                                       (64, 14336, 2048), (3, 100, None)])
def test_quantize_rows_bitwise_reference(m, k, chunk):
    from deepinfer.kernels.fp8_row_quant import quantize_rows

    x = _rows(m, k, seed=k + m)
    _same(quantize_rows(x, chunk=chunk), quantize_rows_ref(x))


def _quantizers(group: int | None):
    """(the kernel, the reference) quantizing an op's output: per row (group None) or per 128-group."""
    from deepinfer.kernels.fp8_matmul import quantize_act
    from deepinfer.kernels.fp8_row_quant import quantize_rows
    from deepinfer.kernels.reference.fp8_matmul import quantize_act_ref

    if group is None:
        return quantize_rows, quantize_rows_ref
    return (lambda y: quantize_act(y, group)), (lambda y: quantize_act_ref(y, group))


@needs_fp8
@pytest.mark.parametrize("h", [4096, 3584, 2048, 896, 128, 100, 5120, 8192])   # > 4096: the unfused path
@pytest.mark.parametrize("m", [1, 37, 256, 2048])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("group", [None, 128], ids=["rows", "groups"])
def test_rms_norm_quant_is_unfused_kernels_bitwise(h, m, with_residual, group):
    from deepinfer.kernels.fp8_fused_quant import rms_norm_quant
    from deepinfer.kernels.fp8_group_quant import rms_norm_group_quant
    from deepinfer.kernels.rmsnorm import rms_norm

    x = _rows(m, h, seed=h + m, scale=4.0)
    r = _rows(m, h, seed=h + m + 1).flip(0).contiguous() if with_residual else None
    gen = torch.Generator(device=CUDA).manual_seed(h)
    w = (1 + 0.3 * torch.randn(h, device=CUDA, generator=gen)).to(torch.bfloat16)
    if group is None:
        q, s, res = rms_norm_quant(x, w, 1e-5, residual=r)
    else:
        q, s, res = rms_norm_group_quant(x, w, 1e-5, group, residual=r)
    if with_residual:
        out, summed = rms_norm(x, w, 1e-5, residual=r)
        assert torch.equal(res, summed)
    else:
        out = rms_norm(x, w, 1e-5)
    quantize, reference = _quantizers(group)
    _same((q, s), quantize(out))
    _same((q, s), reference(out))


@needs_fp8
@pytest.mark.parametrize("i,chunk", [(14336, None), (4864, None), (18944, None), (40000, None),
                                     (14336, 4096), (1408, None), (100, None)])
@pytest.mark.parametrize("m", [1, 7, 64, 256, 2048])
@pytest.mark.parametrize("group", [None, 128], ids=["rows", "groups"])
def test_silu_and_mul_quant_is_unfused_kernels_bitwise(i, chunk, m, group):
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant
    from deepinfer.kernels.fp8_group_quant import silu_and_mul_group_quant

    if group is not None and chunk is not None:
        pytest.skip("the group kernel has one launch path (no chunked form)")
    x = _rows(m, 2 * i, seed=i + m, scale=3.0)
    got = silu_and_mul_quant(x, chunk=chunk) if group is None else silu_and_mul_group_quant(x, group)
    unfused = silu_and_mul(x)
    quantize, reference = _quantizers(group)
    _same(got, quantize(unfused))
    _same(got, reference(unfused))


@needs_fp8
@pytest.mark.parametrize("group", [None, 128], ids=["rows", "groups"])
def test_fused_kernels_rows_invariant_and_capture(group):
    from deepinfer.kernels import fp8_fused_quant, fp8_group_quant

    if group is None:
        rms_norm_quant = fp8_fused_quant.rms_norm_quant
        silu_and_mul_quant = fp8_fused_quant.silu_and_mul_quant
    else:
        def rms_norm_quant(x, w, eps, residual):
            return fp8_group_quant.rms_norm_group_quant(x, w, eps, group, residual=residual)

        def silu_and_mul_quant(g):
            return fp8_group_quant.silu_and_mul_group_quant(g, group)
    x, r = _rows(512, 4096, seed=1), _rows(512, 4096, seed=2)
    w = torch.rand(4096, device=CUDA).to(torch.bfloat16) + 0.5
    g = _rows(512, 2 * 14336, seed=3)
    full_n, full_a = rms_norm_quant(x, w, 1e-5, residual=r), silu_and_mul_quant(g)
    perm = torch.randperm(512, device=CUDA)[:77]
    part_n = rms_norm_quant(x[perm].contiguous(), w, 1e-5, residual=r[perm].contiguous())
    _same(part_n[:2], (full_n[0][perm], full_n[1][perm]))
    assert torch.equal(part_n[2], full_n[2][perm])
    part_a = silu_and_mul_quant(g[perm].contiguous())
    _same(part_a, (full_a[0][perm], full_a[1][perm]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap_n, cap_a = rms_norm_quant(x, w, 1e-5, residual=r), silu_and_mul_quant(g)
    graph.replay()
    torch.cuda.synchronize()
    _same(cap_n[:2], full_n[:2])
    _same(cap_a, full_a)


@needs_fp8
def test_rowwise_linear_on_fused_rows_is_the_quantizing_linear():
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant
    from deepinfer.kernels.fp8_rowwise import fp8_rowwise_linear, fp8_rowwise_linear_quantized

    gen = torch.Generator(device=CUDA).manual_seed(4)
    w = (torch.randn(4096, 14336, device=CUDA, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(4096, 1, device=CUDA, generator=gen) * 1e-3 + 1e-4
    g = _rows(256, 2 * 14336, seed=5)
    for invariant in (True, False):
        fused = fp8_rowwise_linear_quantized(*silu_and_mul_quant(g), w, ws, out_dtype=torch.bfloat16,
                                             invariant=invariant)
        assert torch.equal(fused, fp8_rowwise_linear(silu_and_mul(g), w, ws, invariant=invariant))


@needs_fp8
@pytest.mark.parametrize("m", [1, 256, 400])
@pytest.mark.parametrize("width", [14336, 4096, 100])
def test_column_split_path_is_the_one_program_path_bitwise(m, width):
    """kernels/fp8_split_quant.py (the fused SiLU-and-mul's decode-sized path, automatic below
    SPLIT_MAX_BYTES; the row quantizer's only when forced with `split=N` columns per program) gives the
    one-program kernels' bits (`split=0`), in and out of a CUDA graph."""
    from deepinfer.kernels.fp8_fused_quant import silu_and_mul_quant
    from deepinfer.kernels.fp8_row_quant import quantize_rows

    x = _rows(m, width, seed=width + m, scale=3.0)
    g = _rows(m, 2 * width, seed=width + m + 1, scale=3.0)
    want_q, want_a = quantize_rows(x, split=0), silu_and_mul_quant(g, split=0)
    _same(want_q, quantize_rows_ref(x))
    for split in (None, 1024, 256):   # the default, the default split width, a narrower one
        _same(quantize_rows(x, split=split), want_q)
        _same(silu_and_mul_quant(g, split=split), want_a)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap_q, cap_a = quantize_rows(x), silu_and_mul_quant(g)
    graph.replay()
    torch.cuda.synchronize()
    _same(cap_q, want_q)
    _same(cap_a, want_a)


@needs_fp8
@pytest.mark.parametrize("invariant", [True, False])
def test_block_linear_on_fused_group_rows_is_the_quantizing_linear(invariant):
    """kernels/fp8_block_plan.py: the block GEMM on the fused SiLU-and-mul's group rows gives the bits of
    the linear quantizing silu_and_mul's output itself (down_proj at the 8B shape, block-scaled weight)."""
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_block_plan import BlockPlanner, block_linear, block_linear_quantized
    from deepinfer.kernels.fp8_group_quant import silu_and_mul_group_quant

    gen = torch.Generator(device=CUDA).manual_seed(4)
    q, inv = quantize_fp8_block(torch.randn(4096, 14336, device=CUDA, generator=gen) * 0.02, (128, 128))
    ws = row_scales(inv, 4096, 14336, 128, (128, 128))
    g = _rows(256, 2 * 14336, seed=5)
    planner = BlockPlanner() if invariant else None
    fused = block_linear_quantized(*silu_and_mul_group_quant(g), q, ws, out_dtype=torch.bfloat16,
                                   invariant=invariant, planner=planner, scale_block_n=128)
    assert torch.equal(fused, block_linear(silu_and_mul(g), q, ws, invariant=invariant, planner=planner,
                                           scale_block_n=128))
