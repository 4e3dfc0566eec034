"""The fixed-order split-K of the batch-invariant GEMM (MatmulConfig.split_k > 1, kernels/matmul_split.py)
on CPU under Triton's interpreter (started by test_bi_linear_split_cpu.py), tiny float32/fp16 shapes.

Checks: agreement with the float64 reference (K tails, bias, more splits than k-tiles); the result is
exactly ((p0 + p1) + p2) + bias where p_s is the single-chain kernel over split s's range of k-tiles (the
partials are the same fp32 chains and the sum has one fixed order, whatever M is); and the serial form
(MatmulConfig.serial_split: the ranges one after another in a tile's program) and the TMA kernels of both
forms give the parallel pointer form's bits, so M buckets may mix them.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.matmul import bi_linear_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_bi_linear_split_cpu.py")


@pytest.fixture(scope="module")
def mm():
    interpreted_kernels("matmul_split")
    interpreted_kernels("matmul_tma")
    return interpreted_kernels("matmul")


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("m,n,k,split,bias,dtype", [
    (5, 48, 96, 3, True, torch.float32),       # 3 k-tiles of 32, one each
    (37, 80, 80, 2, False, torch.float32),     # K tail in the last split, N tail
    (9, 32, 64, 5, True, torch.float32),       # more splits than k-tiles: empty splits add zeros
    (19, 64, 96, 2, True, torch.float16),
])
def test_split_k_matches_reference(mm, m, n, k, split, bias, dtype):
    cfg = mm.MatmulConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=split)
    x = _rand(m, k, dtype=dtype, seed=1)
    w = (_rand(n, k, seed=2) / k**0.5).to(dtype)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    out = mm.bi_linear(x, w, b, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), bi_linear_ref(x, w, b).float(), atol=tol, rtol=tol)


def test_split_k_is_the_fixed_order_sum_of_single_chain_partials(mm):
    m, n, k, split, bk = 21, 48, 160, 3, 32          # 5 k-tiles: splits of 2, 2, 1
    x, w, b = _rand(m, k, seed=4), _rand(n, k, seed=5) / k**0.5, _rand(n, seed=6)
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=bk, num_warps=4, num_stages=2, split_k=split)
    chain = mm.MatmulConfig(block_m=16, block_n=16, block_k=bk, num_warps=4, num_stages=2, persistent=False)
    out = mm.bi_linear(x, w, b, config=cfg)
    want = None
    for lo in range(0, k, 2 * bk):
        ks = slice(lo, lo + 2 * bk)
        part = mm.bi_linear(x[:, ks].contiguous(), w[:, ks].contiguous(), config=chain)
        want = part if want is None else want + part
    assert torch.equal(out, want + b)   # (row invariance itself is checked on the GPU: the interpreter's
    # emulated tl.dot need not be row-independent; test_bi_linear_05b_gpu.py)


def test_split_k_config_is_checked(mm):
    with pytest.raises(ValueError, match="split_k"):
        mm.MatmulConfig(block_m=16, block_n=16, block_k=16, split_k=0)


@pytest.mark.parametrize("n,k,split", [
    (64, 2048, 16),    # DeepSeek-V2-Lite's router: 64 experts over hidden 2048
    (256, 1024, 8),    # 256 experts (V3's count) over a shorter K
])
def test_float32_routers_take_a_split_from_k_alone_and_match_the_reference(mm, n, k, split):
    """Narrow float32 weights with a long K (MoE routers) split K into a fixed number of ranges (from K,
    never M), so a decode step runs more than one or two programs; the result still matches."""
    cfg = mm.matmul_config(n, k, torch.float32)
    assert cfg.split_k == split
    assert all(c.split_k == split for _, c in mm._bucket_configs(n, k, torch.float32))
    assert mm.matmul_config(512, k, torch.float32).split_k == 1      # wider: enough column tiles
    assert mm.matmul_config(n, 512, torch.float32).split_k == 1      # short K: nothing to split
    x = _rand(3, k, seed=7)
    w = _rand(n, k, seed=8) / k**0.5
    torch.testing.assert_close(mm.bi_linear(x, w), bi_linear_ref(x, w), atol=1e-5, rtol=1e-5)


SERIAL_CASES = [   # (m, n, k, split, block_k, bias, persistent, dtype)
    (21, 48, 160, 3, 32, True, False, torch.float32),     # 5 k-tiles: ranges of 2, 2, 1
    (37, 80, 80, 2, 32, False, True, torch.float32),      # K tail in the last range; 3 programs, 15 tiles
    (9, 32, 64, 5, 32, True, False, torch.float32),       # more ranges than k-tiles: empty ranges add zeros
    (19, 64, 224, 4, 32, True, True, torch.float16),
]


@pytest.mark.parametrize("m,n,k,split,bk,bias,persistent,dtype", SERIAL_CASES)
def test_serial_and_tma_split_forms_give_the_parallel_forms_bits(mm, m, n, k, split, bk, bias, persistent,
                                                                 dtype):
    from dataclasses import replace

    tma = __import__("deepinfer.kernels.matmul_tma", fromlist=["x"])
    x = _rand(m, k, dtype=dtype, seed=11)
    w = (_rand(n, k, seed=12) / k**0.5).to(dtype)
    b = _rand(n, dtype=dtype, seed=13) if bias else None
    parallel = mm.MatmulConfig(block_m=16, block_n=16, block_k=bk, group_m=2, num_warps=4, num_stages=2,
                               split_k=split)
    want = mm.bi_linear(x, w, b, config=parallel)
    serial = replace(parallel, serial_split=True, persistent=persistent)
    assert torch.equal(mm.bi_linear(x, w, b, config=serial), want)
    # Launched directly: on CPU bi_linear never takes TMA loads (tma_usable needs a CUDA device).
    tiles = -(-m // 16) * -(-n // 16)
    programs = min(tiles, 3) if persistent else tiles
    got = tma.tma_launch(x, w, b, torch.empty(m, n, dtype=dtype), 16, 16, bk, 2, 4, 2, programs, splits=split)
    assert torch.equal(got, want)
    part = tma.tma_split_partials(x, w, torch.empty(split, m, n), 16, 16, bk, 2, 4, 2)
    summed = part[0].clone()
    for s in range(1, split):
        summed += part[s]
    assert torch.equal((summed if b is None else summed + b.float()).to(dtype), want)


def test_serial_split_has_a_swiglu_epilogue_with_the_activations_bits(mm):
    from dataclasses import replace

    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.reference.activation import pairs_to_halves

    m, i, k = 13, 32, 160
    x, w = _rand(m, k, seed=14), _rand(2 * i, k, seed=15) / k**0.5
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=3,
                          serial_split=True)
    want = silu_and_mul(pairs_to_halves(mm.bi_linear(x, w, config=replace(cfg, serial_split=False))))
    assert torch.equal(mm.bi_linear(x, w, config=cfg, swiglu=True), want)


def test_serial_split_without_a_split_is_refused(mm):
    with pytest.raises(ValueError, match="serial_split"):
        mm.MatmulConfig(block_m=16, block_n=16, block_k=16, serial_split=True)


# (m, n, k, split, bias, residual, h_chunk): h_chunk None = one register chunk per row, else the norm's
# widest chunk forced down to it (the two-pass path of rows wider than kernels/rmsnorm._MAX_BLOCK)
SPLIT_NORM_CASES = [
    (5, 48, 96, 3, True, True, None),
    (13, 80, 160, 4, False, True, None),     # N not a power of two: masked columns
    (7, 64, 64, 2, True, False, None),       # no residual: x itself is the new residual stream
    (9, 48, 96, 3, True, True, 16),          # the two-pass path: 3 chunks of 16 columns
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split,bias,residual,h_chunk", SPLIT_NORM_CASES)
def test_rms_norm_of_deferred_partials_has_the_bits_of_the_reduce_then_the_norm(
        mm, monkeypatch, m, n, k, split, bias, residual, h_chunk, dtype):
    """bi_linear(defer_sum=True) hands back the parallel split's partials (a SplitSum); rms_norm sums them
    itself, in the reduce's order and rounding, then adds the residual and normalises: the same output and
    the same new residual stream, bit for bit, as the reduced GEMM output through the plain norm."""
    from tests.kernels.interpreter_bf16 import gpu_like_bf16

    if dtype == torch.bfloat16:
        gpu_like_bf16(monkeypatch)   # casts round to nearest even, as on the GPU
    rn = interpreted_kernels("rmsnorm")
    split_mod = interpreted_kernels("matmul_split")
    if h_chunk is not None:
        monkeypatch.setattr(rn, "_MAX_BLOCK", h_chunk)
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=split)
    x = _rand(m, k, dtype=dtype, seed=21)
    w = (_rand(n, k, seed=22) / k**0.5).to(dtype)
    b = _rand(n, dtype=dtype, seed=23) if bias else None
    r = _rand(m, n, dtype=dtype, seed=24) if residual else None
    nw = (1 + 0.1 * _rand(n, seed=25)).to(dtype)
    deferred = mm.bi_linear(x, w, b, config=cfg, defer_sum=True)
    assert isinstance(deferred, split_mod.SplitSum) and deferred.shape == (m, n)
    reduced = mm.bi_linear(x, w, b, config=cfg)
    assert torch.equal(deferred.materialize(), reduced)
    want = rn.rms_norm(reduced, nw, 1e-5, r)
    got = rn.rms_norm(deferred, nw, 1e-5, r)
    if residual:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)


def test_defer_sum_returns_a_tensor_where_the_config_has_no_parallel_split(mm):
    x, w = _rand(4, 64, seed=26), _rand(32, 64, seed=27)
    for cfg in (mm.MatmulConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2),
                mm.MatmulConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=2,
                                serial_split=True)):
        out = mm.bi_linear(x, w, config=cfg, defer_sum=True)
        assert isinstance(out, torch.Tensor) and torch.equal(out, mm.bi_linear(x, w, config=cfg))


def test_rms_norm_of_deferred_partials_checks_its_operands(mm):
    rn = interpreted_kernels("rmsnorm")
    split_mod = interpreted_kernels("matmul_split")
    part = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(split_mod.SplitSum(part, None, torch.float32), torch.zeros(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rn.rms_norm(split_mod.SplitSum(part, None, torch.float32), torch.zeros(8), 1e-6, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="x.bias"):
        rn.rms_norm(split_mod.SplitSum(part, torch.zeros(5), torch.float32), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="x.part"):
        rn.rms_norm(split_mod.SplitSum(part.half(), None, torch.float16), torch.zeros(8).half(), 1e-6)


def test_flatten_is_checked_and_leaves_the_tma_kernels_result_alone(mm):
    """MatmulConfig.flatten needs one persistent tile loop around one K loop (no split); the TMA kernel
    launched with it computes the same values (the bits on the device: test_matmul_tma_gpu.py)."""
    tma = __import__("deepinfer.kernels.matmul_tma", fromlist=["x"])
    for bad in (dict(persistent=False, tma=True), dict(tma=True, split_k=2, serial_split=True),
                dict(tma=True, split_k=3)):
        with pytest.raises(ValueError, match="flatten"):
            mm.MatmulConfig(block_m=16, block_n=16, block_k=32, flatten=True, **bad)
    x, w, b = _rand(37, 64, seed=31), _rand(48, 64, seed=32) / 8, _rand(48, seed=33)
    args = (x, w, b, 16, 16, 32, 2, 4, 2, 3)
    want = tma.tma_launch(*args[:3], torch.empty(37, 48), *args[3:])
    assert torch.equal(tma.tma_launch(*args[:3], torch.empty(37, 48), *args[3:], flatten=True), want)
