"""FP8 GEMM kernels on CPU under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, started by
tests/kernels/test_fp8_cpu.py), tiny shapes, against kernels/reference/fp8_matmul.py.

The interpreter supports e4m3 loads, stores (with explicit rtne rounding) and `tl.dot`, so the activation
quantizer is checked bitwise and the GEMMs within float32-accumulation tolerance of the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fp8_matmul import (
    fp8_grouped_linear_ref,
    fp8_linear_ref,
    quantize_act_ref,
)

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fp8_cpu.py")

GROUP = 32


@pytest.fixture(scope="module")
def fp8():
    return interpreted_kernels("fp8_matmul", "_fp8_gemm_kernel")


def _weight(n: int, k: int, seed: int, experts: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    w = (torch.randn(*shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*shape[:-1], -(-k // GROUP), generator=gen) * 1e-3 + 1e-4
    return w, s


def _x(m: int, k: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[0, :GROUP] = 0.0  # an all-zero group
    return x.to(dtype)


@pytest.mark.parametrize("m,k", [(1, 64), (5, 80), (19, 96)])
def test_quantize_act_bitwise_reference(fp8, m, k):
    x = _x(m, k, seed=m)
    q, s = fp8.quantize_act(x, GROUP)
    q_ref, s_ref = quantize_act_ref(x, GROUP)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m,n,k,bias,invariant", [(1, 48, 64, False, True), (40, 136, 96, True, False),
                                                   (3, 16, 80, False, True)])
def test_fp8_linear_matches_reference(fp8, m, n, k, bias, invariant):
    w, s = _weight(n, k, seed=n)
    x = _x(m, k, seed=k)
    b = torch.randn(n) if bias else None
    out = fp8.fp8_linear(x, w, s, b, group=GROUP, invariant=invariant)
    ref = fp8_linear_ref(x, w, s, b, group=GROUP)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fp8_linear_rows_do_not_depend_on_batch(fp8):
    w, s = _weight(72, 64, seed=1)
    x = _x(70, 64, seed=2)
    full = fp8.fp8_linear(x, w, s, group=GROUP, invariant=True)
    for m in (1, 33):
        part = fp8.fp8_linear(x[:m].clone(), w, s, group=GROUP, invariant=True)
        assert torch.equal(part, full[:m]), m


def test_fp8_grouped_linear_matches_reference_and_is_row_local(fp8):
    w, s = _weight(40, 64, seed=3, experts=4)
    counts = [5, 0, 20, 2]
    offsets = torch.tensor([0, 5, 5, 25, 27])
    x = _x(sum(counts), 64, seed=4)
    out = fp8.fp8_grouped_linear(x, w, s, offsets, group=GROUP)
    torch.testing.assert_close(out, fp8_grouped_linear_ref(x, w, s, offsets, GROUP), rtol=1e-5, atol=1e-5)
    # Expert 2's rows alone, in a call of their own, give the same bits.
    alone = fp8.fp8_grouped_linear(x[5:25].clone(), w, s, torch.tensor([0, 0, 0, 20, 20]), group=GROUP)
    assert torch.equal(alone, out[5:25])


def test_store_kv_fp8_bitwise_and_paged_attention_reads_it():
    from deepinfer.kernels.kv_fp8 import store_kv_fp8
    from deepinfer.kernels.paged_attention import paged_attention
    from deepinfer.kernels.reference.attention import paged_attention_ref
    from deepinfer.kernels.reference.kv_fp8 import store_kv_fp8_ref

    from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

    gen = torch.Generator().manual_seed(7)
    block_size, heads, kv_heads, dim = 16, 4, 2, 16
    lens = [(21, 3), (6, 6)]
    tables, num_blocks = random_block_lists([c for c, _ in lens], block_size, seed=2)
    meta = build_metadata([SeqStep(b, c, q) for b, (c, q) in zip(tables, lens)], block_size)
    slots = torch.cat([torch.tensor(list(b)).repeat_interleave(block_size)[:c] * block_size
                       + torch.arange(c) % block_size for b, (c, _) in zip(tables, lens)])
    k = torch.randn(slots.shape[0], kv_heads, dim, generator=gen) * 4
    v = torch.randn(slots.shape[0], kv_heads, dim, generator=gen)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.25])
    caches = [torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn) for _ in range(4)]
    store_kv_fp8(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    store_kv_fp8_ref(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    q = torch.randn(meta.num_tokens, heads, dim, generator=gen)
    out = paged_attention(q, caches[0], caches[1], meta, 0.25, k_scale, v_scale)
    ref = paged_attention_ref(q, caches[0], caches[1], meta, 0.25, k_scale, v_scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
