"""GPU (H200, bf16): the Triton kernels at real model shapes against their plain-torch references, and
bitwise batch invariance — rows across batch sizes (GEMM, norm, activation) and a token's attention output
across full prefill, decode, prefix-cache hits, chunked prefill and batch composition.

Tolerances (bf16 outputs; one bf16 ulp is 2^-8..2^-7 relative): GEMM, norm and activation within about one
ulp of references computed in float64/float32, with at most 2% of elements off the reference's rounding;
attention within 2e-2 elementwise and 2e-2 relative L2 per (token, head); the residual sum of the fused
norm is bitwise equal to torch's bf16 add.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.reference.matmul import bi_linear_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
from deepinfer.kernels.reference.store_kv import store_kv_ref

from tests.support.paged_batches import SeqStep, build_metadata, gather_rows, random_block_lists

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kern():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import activation, matmul, paged_attention, rmsnorm, store_kv

    return SimpleNamespace(mm=matmul, rn=rmsnorm, act=activation, sk=store_kv, pa=paged_attention)


def _randn(*shape, seed: int, dtype=BF16, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float32) * scale).to(dtype)


def _assert_close_bf16(got: torch.Tensor, ref: torch.Tensor, atol: float = 1e-2, rtol: float = 1e-2,
                       max_off: float = 0.02) -> None:
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    off = (got != ref).float().mean().item()
    assert off <= max_off, f"{off:.3%} of elements differ from the reference's rounding"


def test_triton_available_on_gpu():
    from deepinfer.kernels import triton_available

    assert triton_available()


# ---------------------------------------------------------------------------------------------- GEMM

LINEAR_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.parametrize("n,k", LINEAR_NK)
@pytest.mark.parametrize("m", [1, 7, 64, 256, 1000])
def test_bi_linear_bf16_matches_reference(kern, m, n, k):
    x = _randn(m, k, seed=1)
    w = _randn(n, k, seed=2, scale=k ** -0.5)
    out = kern.mm.bi_linear(x, w)
    assert out.shape == (m, n) and out.dtype == BF16
    _assert_close_bf16(out, bi_linear_ref(x, w))
    _assert_close_bf16(out, torch.matmul(x, w.T), max_off=0.05)   # cuBLAS: its own order, a few ulps


@pytest.mark.parametrize(
    "m,n,k,dtype,tol",
    [
        (33, 4000, 1000, BF16, 1e-2),             # N and K tails, bias
        (300, 1088, 1000, torch.float16, 5e-3),
        (300, 1088, 1000, torch.float32, 1e-4),    # IEEE fp32 dot, not TF32
        (5, 128256, 4096, BF16, 1e-2),             # lm_head width
    ],
)
def test_bi_linear_shapes_and_dtypes(kern, m, n, k, dtype, tol):
    x = _randn(m, k, seed=3, dtype=dtype)
    w = _randn(n, k, seed=4, dtype=dtype, scale=k ** -0.5)
    b = _randn(n, seed=5, dtype=dtype)
    out = kern.mm.bi_linear(x, w, b)
    torch.testing.assert_close(out.float(), bi_linear_ref(x, w, b).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336)])   # both tile configs
@pytest.mark.parametrize("bias", [False, True])
def test_bi_linear_rows_bitwise_invariant_across_batch_sizes(kern, n, k, bias):
    x = _randn(1000, k, seed=6)
    w = _randn(n, k, seed=7, scale=k ** -0.5)
    b = _randn(n, seed=8) if bias else None
    full = kern.mm.bi_linear(x, w, b)
    for m in (1, 7, 64, 256):
        for start in (0, 1, 500, 1000 - m):
            view = kern.mm.bi_linear(x[start:start + m], w, b)
            copy = kern.mm.bi_linear(x[start:start + m].clone(), w, b)
            assert torch.equal(view, full[start:start + m]), f"M={m} rows {start}.. (view)"
            assert torch.equal(copy, full[start:start + m]), f"M={m} rows {start}.. (copy)"


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_planner_bucket_configs_agree_and_rows_stay_invariant_across_buckets(kern, n, k):
    """The M-bucket configs are used on the H200 (they agree bitwise), and a row's bits are the same at
    every M, across bucket boundaries (64/65, 256/257) and against the single-config kernel."""
    planner = kern.mm.MatmulPlanner()
    x = _randn(1000, k, seed=9)
    w = _randn(n, k, seed=10, scale=k ** -0.5)
    full = kern.mm.bi_linear(x, w, planner=planner)
    assert all(planner.verdicts().values()), planner.verdicts()
    assert torch.equal(full, kern.mm.bi_linear(x, w))
    for m in (1, 7, 63, 64, 65, 255, 256, 257, 999):
        for start in (0, 1000 - m):
            part = kern.mm.bi_linear(x[start:start + m].clone(), w, planner=planner)
            assert torch.equal(part, full[start:start + m]), f"M={m} rows {start}.."


# ----------------------------------------------------------------------------------- norm, activation

@pytest.mark.parametrize("h", [896, 4096, 20480])
@pytest.mark.parametrize("m", [1, 7, 256, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bf16_matches_hf_rounding(kern, h, m, with_residual):
    x = _randn(m, h, seed=9)
    r = _randn(m, h, seed=10) if with_residual else None
    w = (1 + _randn(h, seed=11, dtype=torch.float32, scale=0.1)).to(BF16)
    got = kern.rn.rms_norm(x, w, 1e-5, r)
    ref = rms_norm_ref(x, w, 1e-5, r)
    if with_residual:
        assert torch.equal(got[1], ref[1]), "residual sum must be torch's bf16 add, bitwise"
        got, ref = got[0], ref[0]
    _assert_close_bf16(got, ref, atol=1e-3, rtol=1.6e-2)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rows_bitwise_invariant(kern, with_residual):
    x, r = _randn(1000, 4096, seed=12), _randn(1000, 4096, seed=13)
    w = _randn(4096, seed=14)
    res = r if with_residual else None
    full = kern.rn.rms_norm(x, w, 1e-6, res)
    for m in (1, 7, 64, 256):
        for start in (0, 500, 1000 - m):
            sl = slice(start, start + m)
            part = kern.rn.rms_norm(x[sl].clone(), w, 1e-6, r[sl].clone() if with_residual else None)
            if with_residual:
                assert torch.equal(part[0], full[0][sl]) and torch.equal(part[1], full[1][sl])
            else:
                assert torch.equal(part, full[sl])


@pytest.mark.parametrize("m,i", [(1, 14336), (256, 14336), (4096, 4864)])
def test_silu_and_mul_bf16_matches_reference(kern, m, i):
    x = _randn(m, 2 * i, seed=15, scale=3.0)
    got = kern.act.silu_and_mul(x)
    _assert_close_bf16(got, silu_and_mul_ref(x), atol=1e-3, rtol=1.6e-2)
    assert torch.equal(kern.act.silu_and_mul(x[m // 2:m // 2 + 1].clone()), got[m // 2:m // 2 + 1])


def test_store_kv_bf16_matches_reference(kern):
    t, hkv, d, bs, nb = 4096, 8, 128, 16, 400
    qkv = _randn(t, (32 + 2 * hkv) * d, seed=16)
    k = qkv[:, 32 * d:(32 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (32 + hkv) * d:].view(t, hkv, d)
    gen = torch.Generator(device=DEV).manual_seed(17)
    slots = torch.randperm(nb * bs, generator=gen, device=DEV)[:t]
    slots[::97] = -1
    caches = [torch.zeros((nb, bs, hkv, d), dtype=BF16, device=DEV) for _ in range(4)]
    kern.sk.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ----------------------------------------------------------------------------------------- attention

def _attention_setup(kern, lens, hq, hkv, d, block_size, seed):
    blocks, num_blocks = random_block_lists(lens, block_size, seed=seed)
    q = [_randn(n, hq, d, seed=seed * 1000 + 3 * b) for b, n in enumerate(lens)]
    k = [_randn(n, hkv, d, seed=seed * 1000 + 3 * b + 1) for b, n in enumerate(lens)]
    v = [_randn(n, hkv, d, seed=seed * 1000 + 3 * b + 2) for b, n in enumerate(lens)]
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=BF16, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], block_size, DEV)
    kern.sk.store_kv(torch.cat(k), torch.cat(v), k_cache, v_cache, fill.slot_mapping)
    return blocks, q, k_cache, v_cache


def _step(kern, setup, rows, block_size, scale):
    """rows: (seq, first new position, context length after the step) per sequence of the step."""
    blocks, q, k_cache, v_cache = setup
    meta = build_metadata([SeqStep(blocks[b], ctx, ctx - lo) for b, lo, ctx in rows], block_size, DEV)
    qs = gather_rows(q, rows)
    return kern.pa.paged_attention(qs, k_cache, v_cache, meta, scale), meta, qs


ATTN_CASES = {
    "llama8b-256x512": dict(hq=32, hkv=8, d=128, bs=16, lens=[512] * 256),
    "qwen0.5b-mixed": dict(hq=14, hkv=2, d=64, bs=16, lens=[1, 15, 16, 17, 100, 333, 640, 1024]),
    "llama8b-block32": dict(hq=32, hkv=8, d=128, bs=32, lens=[77, 200, 513, 1000]),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention_bf16_matches_reference(kern, case):
    c = ATTN_CASES[case]
    scale = c["d"] ** -0.5
    setup = _attention_setup(kern, c["lens"], c["hq"], c["hkv"], c["d"], c["bs"], seed=1)
    for rows in ([(b, 0, n) for b, n in enumerate(c["lens"])],            # prefill
                 [(b, n // 3, n) for b, n in enumerate(c["lens"])],       # prefix-cache hit
                 [(b, n - 1, n) for b, n in enumerate(c["lens"])]):       # decode
        out, meta, qs = _step(kern, setup, rows, c["bs"], scale)
        assert not out.isnan().any(), "unwritten (NaN) cache slots leaked into the output"
        ref = paged_attention_ref(qs, setup[2], setup[3], meta, scale).float()
        # p is rounded to bf16 before the PV product, so single elements may be a few ulps off; a per-row
        # relative error bound catches logic errors (an off-by-one mask at position 511 moves a row ~4%).
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        row_err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-3)
        assert row_err.max().item() < 2e-2, f"worst (token, head) relative error {row_err.max().item():.2e}"


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention_bitwise_invariant_to_scheduling(kern, case):
    """A token's output is the same bits from a full prefill, decode, prefix-cache hits, chunked prefill,
    alone or in any batch."""
    c = ATTN_CASES[case]
    lens, bs, scale = c["lens"], c["bs"], c["d"] ** -0.5
    setup = _attention_setup(kern, lens, c["hq"], c["hkv"], c["d"], bs, seed=2)
    full, *_ = _step(kern, setup, [(b, 0, n) for b, n in enumerate(lens)], bs, scale)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)

    def check(rows, label):
        out, *_ = _step(kern, setup, rows, bs, scale)
        i = 0
        for b, lo, ctx in rows:
            want = full[offsets[b] + lo:offsets[b] + ctx]
            assert torch.equal(out[i:i + ctx - lo], want), f"{case} {label}: seq {b} positions [{lo}, {ctx})"
            i += ctx - lo

    probe = sorted({0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 511, 512, 1023})
    check([(b, p, p + 1) for b, n in enumerate(lens) for p in probe if p < n], "decode batch")
    last = len(lens) - 1
    check([(last, lens[last] - 1, lens[last])], "decode alone")
    check([(b, (7 * b + 5) % n, n) for b, n in enumerate(lens)], "prefix hits")
    check([(last, 0, lens[last])], "prefill alone")
    for cut in (1, 16, 37):   # chunked prefill of the last sequence, next to decodes of the others
        lo, hi = min(cut, lens[last] - 1), min(cut + 150, lens[last])
        others = [(b, n - 1, n) for b, n in enumerate(lens[:8]) if b != last]
        check([(last, 0, lo)] + others, f"chunk [0, {lo})")
        check(others + [(last, lo, hi)], f"chunk [{lo}, {hi})")
