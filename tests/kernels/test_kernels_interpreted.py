"""The Triton kernels on CPU under Triton's interpreter, tiny shapes (a subprocess with TRITON_INTERPRET=1).

Triton decides at import time whether @triton.jit builds interpreter functions (its own standard library
included), so this module only runs in a process started with TRITON_INTERPRET=1:
tests/kernels/test_kernels_cpu.py
starts one. Checks: agreement with the plain-torch `*_ref` beside each kernel (float32: tight; bf16: the
interpreter rounds float32->bf16 by truncation where the GPU rounds to nearest, so only a 1-2 ulp tolerance
is meaningful here) and batch invariance (bitwise).

Not checkable here: bf16 `tl.dot` (the interpreter multiplies bf16 storage as uint16), GPU numerics and
speed — tests/kernels/test_kernels_gpu.py covers those.
"""

from __future__ import annotations

import functools

import pytest
import torch
from deepinfer.kernels.metadata import KV_CHUNK
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.reference.matmul import bi_linear_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
from deepinfer.kernels.reference.store_kv import store_kv_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import (
    SeqStep,
    build_metadata,
    check_rows_bitwise,
    gather_rows,
    random_block_lists,
    rows_by_position,
)

_KERNEL_MODULES = ("matmul", "matmul_tma", "rmsnorm", "activation", "store_kv", "paged_attention")

skip_unless_interpreting("tests/kernels/test_kernels_cpu.py")


@pytest.fixture(scope="module")
def kmods():
    return {name: interpreted_kernels(name) for name in _KERNEL_MODULES}


# Bitwise invariance is a property of the compiled kernels; Triton's CPU interpreter emulates tl.dot with
# host matmuls whose rounding is not guaranteed to be row-independent (seen with triton 3.8/3.9 on an AMD
# EPYC host). The GPU tests test_bi_linear_rows_bitwise_invariant_across_batch_sizes and
# test_paged_attention_bitwise_invariant_to_scheduling check it for real.
_INVARIANCE_ON_GPU_ONLY = pytest.mark.skip(
    reason="bitwise invariance is checked on the GPU (test_kernels_gpu.py)")


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------------- matmul

@pytest.mark.parametrize(
    "m,n,k,bias,dtype",
    [
        (1, 64, 64, False, torch.float32),
        (37, 96, 80, True, torch.float32),      # K tail (80 % 32 != 0), N tail, bias
        (130, 200, 64, False, torch.float32),   # several tiles per persistent program
        (19, 160, 96, True, torch.float16),
    ],
)
def test_bi_linear_matches_reference(kmods, m, n, k, bias, dtype):
    mm = kmods["matmul"]
    x = _rand(m, k, dtype=dtype, seed=1)
    w = (_rand(n, k, seed=2) / k**0.5).to(dtype)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    out = mm.bi_linear(x, w, b)
    ref = bi_linear_ref(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@_INVARIANCE_ON_GPU_ONLY
def test_bi_linear_rows_are_batch_invariant(kmods):
    mm = kmods["matmul"]
    k, n = 96, 160
    x = _rand(256, k, seed=4)
    w = _rand(n, k, seed=5)
    b = _rand(n, seed=6)
    full = mm.bi_linear(x, w, b)
    for m in (1, 7, 64):
        for start in (0, 3, 256 - m):
            part = mm.bi_linear(x[start:start + m].clone(), w, b)
            assert torch.equal(part, full[start:start + m]), (m, start)


def test_bi_linear_config_never_depends_on_batch(kmods):
    mm = kmods["matmul"]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (64, 32)):
            cfg = mm.matmul_config(n, k, dtype)
            assert cfg == mm.matmul_config(n, k, dtype)
            assert "m" not in mm.matmul_config.__code__.co_varnames


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bucket_configs_keep_block_k_and_cover_every_m(kmods, n, k, dtype):
    mm = kmods["matmul"]
    buckets = mm._bucket_configs(n, k, dtype)
    assert buckets[-1][0] is None                       # the last bucket is open-ended
    bounds = [b for b, _ in buckets[:-1]]
    assert bounds == sorted(bounds)
    assert {cfg.block_k for _, cfg in buckets} == {mm.matmul_config(n, k, dtype).block_k}
    assert buckets == mm._bucket_configs(n, k, dtype)


def test_planner_uses_buckets_only_after_they_agree_and_decides_once(kmods, monkeypatch):
    mm = kmods["matmul"]
    n, k = 160, 96
    x, w = _rand(70, k, seed=1), _rand(n, k, seed=2)
    small = mm.MatmulConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    large = mm.MatmulConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(mm, "_bucket_configs", lambda n_, k_, d_: ((64, small), (None, large)))
    calls = []
    monkeypatch.setattr(mm.MatmulPlanner, "_agree", staticmethod(lambda *a: calls.append(1) or True))
    planner = mm.MatmulPlanner()
    assert planner.config(x[:64], w, None) == small
    assert planner.config(x, w, None) == large
    assert len(calls) == 1 and planner.verdicts() == {f"{n}x{k} float32 cpu": True}
    monkeypatch.setattr(mm.MatmulPlanner, "_agree", staticmethod(lambda *a: False))
    doubtful = mm.MatmulPlanner()
    for rows in (1, 64, 70):   # configs that disagree: the shape's single config for every M
        assert doubtful.config(x[:rows], w, None) == mm.matmul_config(n, k, torch.float32)


def test_planner_proof_does_not_trust_degenerate_call_operands(kmods):
    # A CUDA-graph warm-up's first call can carry all-zero rows: every config "agrees" on them. The proof
    # must multiply its own random rows, so configs with different K chains are still told apart.
    mm = kmods["matmul"]
    zeros, w = torch.zeros(8, 64), _rand(96, 64, seed=4)
    k16 = mm.MatmulConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    k32 = mm.MatmulConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    assert torch.equal(mm.bi_linear(zeros, w, config=k16), mm.bi_linear(zeros, w, config=k32))
    assert not mm.MatmulPlanner._agree(zeros, w, None, ((16, k16), (None, k32)))
    assert mm.MatmulPlanner._agree(zeros, w, None, ((16, k32), (None, k32)))


@pytest.mark.parametrize("m,n,k,bias,persistent", [
    (37, 40, 80, True, False),      # ragged M and N, K % BLOCK_K != 0 (TMA zero-fills, pointers mask)
    (70, 33, 64, False, True),      # the persistent loop: 3 programs over 15 tiles in grouped order
    (5, 16, 32, True, True),        # fewer rows than a tile
])
def test_tma_kernel_gives_the_pointer_kernels_bits(kmods, m, n, k, bias, persistent):
    # Launched directly: on CPU bi_linear never takes TMA loads (tma_usable needs a CUDA device).
    mm, tma = kmods["matmul"], kmods["matmul_tma"]
    cfg = mm.MatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2,
                          persistent=persistent)
    x, w = _rand(m, k, seed=5), _rand(n, k, seed=6)
    b = _rand(n, seed=7) if bias else None
    tiles = -(-m // 16) * -(-n // 16)
    programs = min(tiles, 3) if persistent else tiles
    got = tma.tma_launch(x, w, b, torch.empty(m, n), 16, 16, 32, 2, 4, 2, programs)
    assert torch.equal(got, mm.bi_linear(x, w, b, config=cfg))
    ref = bi_linear_ref(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_planner_agreement_check_compares_real_outputs(kmods):
    mm = kmods["matmul"]
    x, w = _rand(40, 64, seed=3), _rand(96, 64, seed=4)
    cfg = mm.MatmulConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    assert mm.MatmulPlanner._agree(x, w, None, ((16, cfg), (None, cfg)))
    out = mm.bi_linear(x, w, planner=mm.MatmulPlanner())
    torch.testing.assert_close(out, bi_linear_ref(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "args,match",
    [
        (((3, 8), (4, 9), None), "does not match"),
        (((3, 8), (4, 8), (5,)), "bias"),
        (((8,), (4, 8), None), "dimensions"),
    ],
)
def test_bi_linear_rejects_bad_shapes(kmods, args, match):
    xs, ws, bs = args
    with pytest.raises(ValueError, match=match):
        kmods["matmul"].bi_linear(torch.zeros(xs), torch.zeros(ws), None if bs is None else torch.zeros(bs))


def test_bi_linear_rejects_mixed_dtypes_and_strides(kmods):
    mm = kmods["matmul"]
    with pytest.raises(ValueError, match="dtype"):
        mm.bi_linear(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        mm.bi_linear(torch.zeros(8, 2).T, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="not supported"):
        mm.bi_linear(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32))


# --------------------------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("h", [48, 300, 8200])   # 8200 > the widest register chunk: the two-pass path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(kmods, h, dtype, with_residual):
    rn = kmods["rmsnorm"]
    x = _rand(5, h, dtype=dtype, seed=7)
    w = (1 + 0.1 * _rand(h, seed=8)).to(dtype)
    r = _rand(5, h, dtype=dtype, seed=9) if with_residual else None
    got = rn.rms_norm(x, w, 1e-6, r)
    ref = rms_norm_ref(x, w, 1e-6, r)
    got, ref = (got, ref) if with_residual else ((got, None), (ref, None))
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
        if with_residual:
            assert torch.equal(got[1], ref[1])
    else:   # interpreter truncates fp32->bf16: allow one bf16 ulp (2^-7 relative) plus a little
        torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=1.6e-2)
        if with_residual:
            torch.testing.assert_close(got[1].float(), ref[1].float(), atol=1e-2, rtol=8e-3)


def test_rms_norm_rows_are_batch_invariant(kmods):
    rn = kmods["rmsnorm"]
    x, r = _rand(64, 96, seed=10), _rand(64, 96, seed=11)
    w = _rand(96, seed=12)
    full, full_res = rn.rms_norm(x, w, 1e-5, r)
    for m, start in ((1, 0), (1, 63), (7, 20)):
        part, part_res = rn.rms_norm(x[start:start + m].clone(), w, 1e-5, r[start:start + m].clone())
        assert torch.equal(part, full[start:start + m]) and torch.equal(part_res, full_res[start:start + m])


def test_rms_norm_rejects_mismatched_weight(kmods):
    with pytest.raises(ValueError, match="weight"):
        kmods["rmsnorm"].rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kmods["rmsnorm"].rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-6, torch.zeros(3, 8))


# ------------------------------------------------------------------------------------------ activation

@pytest.mark.parametrize("m,i", [(1, 8), (3, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(kmods, m, i, dtype):
    act = kmods["activation"]
    x = (3 * _rand(m, 2 * i, seed=13)).to(dtype)
    got, ref = act.silu_and_mul(x), silu_and_mul_ref(x)
    assert got.shape == (m, i)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


def test_silu_and_mul_rejects_odd_width(kmods):
    with pytest.raises(ValueError, match="even"):
        kmods["activation"].silu_and_mul(torch.zeros(2, 7))


# ---------------------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_padding(kmods, dtype):
    sk = kmods["store_kv"]
    num_blocks, block_size, hkv, d = 6, 16, 3, 16
    t = 9
    qkv = _rand(t, (4 + 2 * hkv) * d, dtype=dtype, seed=14)   # k, v as strided views of a fused qkv output
    k = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([17, 18, 19, -1, 40, 41, 5, 95, -1])
    caches = [torch.full((num_blocks, block_size, hkv, d), 7.0, dtype=dtype) for _ in range(4)]
    sk.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 7.0).any(-1).any(-1).sum()) == 7


def test_store_kv_rejects_shape_mismatch(kmods):
    with pytest.raises(ValueError, match="slot_mapping"):
        kmods["store_kv"].store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), torch.zeros(4, 16, 2, 16),
                                   torch.zeros(4, 16, 2, 16), torch.zeros(2, dtype=torch.int64))


# ------------------------------------------------------------------------------------------- attention

def _attention_setup(kmods, lens, hq, hkv, d, block_size, seed=0):
    """Random q/k/v for whole sequences, the k/v of every position stored in a NaN-filled paged cache."""
    blocks, num_blocks = random_block_lists(lens, block_size, seed=seed)
    q = [_rand(n, hq, d, seed=seed * 100 + 3 * b) for b, n in enumerate(lens)]
    k = [_rand(n, hkv, d, seed=seed * 100 + 3 * b + 1) for b, n in enumerate(lens)]
    v = [_rand(n, hkv, d, seed=seed * 100 + 3 * b + 2) for b, n in enumerate(lens)]
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], block_size)
    kmods["store_kv"].store_kv(torch.cat(k), torch.cat(v), k_cache, v_cache, fill.slot_mapping)
    return blocks, q, k_cache, v_cache


def _run_step(kmods, blocks, q, k_cache, v_cache, rows, block_size, scale=0.3):
    """rows: (seq, first new position, context length after the step) per sequence of the step."""
    meta = build_metadata([SeqStep(blocks[b], ctx, ctx - lo) for b, lo, ctx in rows], block_size)
    qs = gather_rows(q, [(b, lo, ctx) for b, lo, ctx in rows])
    return kmods["paged_attention"].paged_attention(qs, k_cache, v_cache, meta, scale), meta, qs


@pytest.mark.parametrize(
    "hq,hkv,d,block_size,lens",
    [
        (4, 2, 16, 16, [37, 70]),       # GQA 2, prefill spans several KV tiles
        (14, 2, 32, 32, [5, 66]),       # GQA 7 (not a power of two): 9 tokens per program
        (2, 2, 16, 8, [20]),            # MHA, blocks smaller than a KV tile
    ],
)
def test_paged_attention_matches_reference(kmods, hq, hkv, d, block_size, lens):
    blocks, q, k_cache, v_cache = _attention_setup(kmods, lens, hq, hkv, d, block_size, seed=1)
    rows = [(b, n // 3, n) for b, n in enumerate(lens)]          # a prefix already cached
    out, meta, qs = _run_step(kmods, blocks, q, k_cache, v_cache, rows, block_size)
    ref = paged_attention_ref(qs, k_cache, v_cache, meta, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@_INVARIANCE_ON_GPU_ONLY
def test_paged_attention_is_invariant_to_scheduling(kmods):
    """A token's output is bitwise the same computed in a full prefill, in decode, after a prefix-cache
    hit, in chunked prefill, and whatever other sequences share the step."""
    hq, hkv, d, bs = 4, 2, 16, 16
    lens = [45, 83]
    blocks, q, k_cache, v_cache = _attention_setup(kmods, lens, hq, hkv, d, bs, seed=2)
    full, *_ = _run_step(kmods, blocks, q, k_cache, v_cache, [(b, 0, n) for b, n in enumerate(lens)], bs)
    want = rows_by_position(full, lens)
    check = functools.partial(check_rows_bitwise, want)   # check(rows, out, label)

    # decode: every position of both sequences as one-token steps, all in one batch
    rows = [(b, p, p + 1) for b, n in enumerate(lens) for p in range(n)]
    check(rows, _run_step(kmods, blocks, q, k_cache, v_cache, rows, bs)[0], "decode")
    # prefix-cache hits at chunk-aligned and unaligned prefixes, sequence alone and with the other one
    for rows in ([(1, 16, 83)], [(1, 29, 83), (0, 44, 45)], [(0, 1, 45), (1, 64, 83)]):
        check(rows, _run_step(kmods, blocks, q, k_cache, v_cache, rows, bs)[0], f"prefix {rows}")
    # chunked prefill: uneven chunks, other sequence decoding alongside
    for rows in ([(1, 0, 13), (0, 40, 41)], [(1, 13, 50)], [(1, 50, 83), (0, 41, 42)]):
        check(rows, _run_step(kmods, blocks, q, k_cache, v_cache, rows, bs)[0], f"chunk {rows}")


def test_paged_attention_tiles_are_kv_chunk_aligned(kmods):
    pa = kmods["paged_attention"]
    for group in (1, 4, 7, 8):
        for d in (64, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                cfg = pa.attention_tile_config(group, d, dtype)
                assert cfg["BLOCK_N"] % KV_CHUNK == 0
                assert cfg["BLOCK_Q"] * group <= cfg["BLOCK_M"] and cfg["BLOCK_Q"] >= 1


@pytest.mark.parametrize(
    "q_shape,cache_shape,match",
    [
        ((3, 4, 16), (4, 16, 3, 16), "multiple"),     # 4 query heads over 3 kv heads
        ((3, 4, 24), (4, 16, 2, 24), "head_dim"),     # not a power of two
        ((3, 4, 16), (4, 8, 2, 16), "block_size"),    # cache block size differs from meta's
        ((2, 4, 16), (4, 16, 2, 16), "tokens"),       # meta describes 3 tokens
    ],
)
def test_paged_attention_rejects_inconsistent_inputs(kmods, q_shape, cache_shape, match):
    meta = build_metadata([SeqStep([1], 3, 3)], 16)
    with pytest.raises(ValueError, match=match):
        kmods["paged_attention"].paged_attention(torch.zeros(q_shape), torch.zeros(cache_shape),
                                                 torch.zeros(cache_shape), meta, 1.0)


def test_paged_attention_reads_q_from_a_fused_qkv_view(kmods):
    hq, hkv, d, bs = 4, 2, 16, 16
    lens = [21, 9]
    blocks, q, k_cache, v_cache = _attention_setup(kmods, lens, hq, hkv, d, bs, seed=3)
    rows = [(b, 0, n) for b, n in enumerate(lens)]
    out, meta, qs = _run_step(kmods, blocks, q, k_cache, v_cache, rows, bs)
    t = qs.shape[0]
    qkv = torch.cat([qs.reshape(t, hq * d), _rand(t, 2 * hkv * d, seed=4)], dim=1)
    q_view = qkv[:, :hq * d].view(t, hq, d)
    assert q_view.stride(0) != hq * d
    assert torch.equal(kmods["paged_attention"].paged_attention(q_view, k_cache, v_cache, meta, 0.3), out)


def test_attention_plan_is_rebuilt_when_meta_is_refilled(kmods):
    pa = kmods["paged_attention"]
    meta = build_metadata([SeqStep([1, 2], 20, 20), SeqStep([3], 5, 1)], 16)
    first = pa._plan_tensor(meta, 16, torch.device("cpu"))
    assert first.tolist() == [0, 1, 0, 0, 1, 0]          # heaviest first: seq 0's 2nd block ends at 20
    assert pa._plan_tensor(meta, 16, torch.device("cpu")) is first
    meta.query_lens_cpu[0] = 3
    assert pa._plan_tensor(meta, 16, torch.device("cpu")).tolist() == [0, 0, 1, 0]
