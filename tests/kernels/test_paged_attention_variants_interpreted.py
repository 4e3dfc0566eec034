"""The paged-attention kernel's tile variants under Triton's interpreter (a TRITON_INTERPRET=1 subprocess
started by tests/kernels/test_paged_attention_variants_cpu.py), tiny shapes, against paged_attention_ref.

Variants: SWAP (transposed tiles S^T = K Q^T), decode tiles (BLOCK_M 16), FP16_KV (the e4m3 cache's fp16
products, q rescaled row by row by powers of two), V_NAT (value tiles loaded in memory order and transposed
in registers). float32 q runs the kernel's IEEE path, so agreement is
tight; FP16_KV rounds p to fp16 (2^-11 relative) and is checked at 2e-3. q values are bf16-representable
(as the engine's are), which the FP16_KV conversion keeps exactly. Bitwise invariance needs the compiled
kernels: tests/kernels/test_paged_attention_decode_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.attention import paged_attention_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import float32_and_e4m3_step

skip_unless_interpreting("tests/kernels/test_paged_attention_variants_cpu.py")

BS, HQ, HKV, D = 16, 8, 2, 16
LENS = [(37, 5), (20, 20), (70, 1), (1, 1)]     # (context, new tokens): prefix hit, prefill, decodes


@pytest.fixture(scope="module")
def pa():
    return interpreted_kernels("paged_attention")


@pytest.fixture(scope="module")
def caches():
    """A NaN-filled float32 cache and an e4m3 cache holding the same keys/values, the step's metadata."""
    c = float32_and_e4m3_step(LENS, BS, HQ, HKV, D, seed=11, table_seed=3)
    st = c.pop("st")
    return dict(c, meta=st.meta, kf=st.k_cache, vf=st.v_cache)


def _cfg(block_m: int, swap: int, fp16_kv: int = 0, vnat: int = 0, vcvt: int = 0,
         prefetch: int = 0, dot_sum: int = 0) -> dict[str, int]:
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // (HQ // HKV), "BLOCK_N": 32, "num_warps": 4,
            "num_stages": 2, "SWAP": swap, "FP16_KV": fp16_kv, "V_NAT": vnat, "V_CVT": vcvt,
            "PREFETCH": prefetch, "DOT_SUM": dot_sum}


def _args(c: dict, cache: str) -> tuple:
    """`launch_paged_attention`'s leading arguments over the float32 ("f32"), the float16 ("f16": the same
    values rounded, fp16 q; the interpreter's bf16 tl.dot is not exact, so a 16-bit cache is tested in fp16
    here and in bf16 on the GPU) or the e4m3 cache, scale 0.3."""
    if cache == "f32":
        return (c["q"], c["kf"], c["vf"], c["meta"], 0.3, None, None)
    if cache == "f16":
        h = torch.float16
        return (c["q"].to(h), c["kf"].to(h), c["vf"].to(h), c["meta"], 0.3, None, None)
    return (c["q"], c["k8"], c["v8"], c["meta"], 0.3, c["ks"], c["vs"])


@pytest.mark.parametrize("block_m,swap,vnat", [(64, 0, 0), (16, 0, 0), (16, 1, 0), (64, 1, 0), (16, 1, 1)])
def test_variants_match_reference_bf16_layout_cache(pa, caches, block_m, swap, vnat):
    c = caches
    out = pa.launch_paged_attention(c["q"], c["kf"], c["vf"], c["meta"], 0.3, None, None,
                                    _cfg(block_m, swap, vnat=vnat))
    ref = paged_attention_ref(c["q"], c["kf"], c["vf"], c["meta"], 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_m,swap,fp16_kv", [(64, 0, 0), (16, 1, 0), (64, 0, 1), (16, 1, 1), (64, 1, 1)])
def test_variants_match_reference_e4m3_cache(pa, caches, block_m, swap, fp16_kv):
    c = caches
    out = pa.launch_paged_attention(c["q"], c["k8"], c["v8"], c["meta"], 0.3, c["ks"], c["vs"],
                                    _cfg(block_m, swap, fp16_kv))
    ref = paged_attention_ref(c["q"], c["k8"], c["v8"], c["meta"], 0.3, c["ks"], c["vs"])
    tol = 2e-3 if fp16_kv else 2e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_m,fp16_kv", [(16, 1), (64, 1), (16, 0)])
def test_natural_value_tiles_match_reference_e4m3_cache(pa, caches, block_m, fp16_kv):
    """V_NAT (value tiles loaded in memory order, transposed in registers) on the e4m3 cache: the same
    values as the transposed load, so it agrees with the reference and with the V_NAT=0 kernel."""
    args = _args(caches, "e4m3")
    out = pa.launch_paged_attention(*args, _cfg(block_m, 1, fp16_kv, vnat=1))
    base = pa.launch_paged_attention(*args, _cfg(block_m, 1, fp16_kv))
    tol = 2e-3 if fp16_kv else 2e-5
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=tol, rtol=tol)
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_m,swap,vnat,fp16_kv", [(16, 0, 0, 1), (32, 0, 0, 1), (16, 0, 0, 0),
                                                      (16, 1, 1, 1), (64, 1, 1, 1)])
def test_converted_value_operand_is_the_same_attention(pa, caches, block_m, swap, vnat, fp16_kv):
    """V_CVT (the converted e4m3 value tile times an exact 1 before the MMA): the same values, so the
    reference's attention and the V_CVT=0 kernel's output."""
    args = _args(caches, "e4m3")
    out = pa.launch_paged_attention(*args, _cfg(block_m, swap, fp16_kv, vnat=vnat, vcvt=1))
    base = pa.launch_paged_attention(*args, _cfg(block_m, swap, fp16_kv, vnat=vnat))
    tol = 2e-3 if fp16_kv else 2e-5
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=tol, rtol=tol)
    torch.testing.assert_close(out, base, atol=0, rtol=0)


@pytest.mark.parametrize("cache,block_m,fp16_kv,vcvt", [
    ("f32", 16, 0, 0), ("f32", 64, 0, 0), ("f32", 32, 0, 0), ("e4m3", 16, 1, 1), ("e4m3", 32, 1, 1),
    ("e4m3", 64, 0, 0)])
def test_prefetched_block_ids_are_the_same_attention(pa, caches, cache, block_m, fp16_kv, vcvt):
    """PREFETCH (each tile's block ids requested one tile ahead) moves data earlier, never the arithmetic:
    the output equals the plain kernel's bit for bit (the same positions are read, masked ones never),
    and the reference's attention."""
    args = _args(caches, cache)
    out = pa.launch_paged_attention(*args, _cfg(block_m, 0, fp16_kv, vcvt=vcvt, prefetch=1))
    base = pa.launch_paged_attention(*args, _cfg(block_m, 0, fp16_kv, vcvt=vcvt))
    tol = {"f32": 2e-5, "e4m3": 2e-3 if fp16_kv else 2e-5, "f16": 2e-3}[cache]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out, base, atol=0, rtol=0)


@pytest.mark.parametrize("cache,block_m,fp16_kv,vcvt,prefetch", [
    ("f32", 16, 0, 0, 0), ("f32", 32, 0, 0, 1), ("f32", 64, 0, 0, 0), ("e4m3", 16, 1, 1, 1),
    ("e4m3", 32, 1, 1, 1), ("e4m3", 64, 0, 0, 0), ("f16", 16, 0, 0, 0), ("f16", 64, 0, 0, 0)])
def test_row_sums_through_the_tensor_core_are_the_same_attention(pa, caches, cache, block_m, fp16_kv, vcvt,
                                                                 prefetch):
    """DOT_SUM (each row's softmax denominator summed as p @ ones, of the rounded p that multiplies V)
    gives the reference's attention: the denominator sums the same probabilities as the numerator."""
    args = _args(caches, cache)
    out = pa.launch_paged_attention(*args, _cfg(block_m, 0, fp16_kv, vcvt=vcvt, prefetch=prefetch,
                                                dot_sum=1))
    tol = {"f32": 2e-5, "e4m3": 2e-3 if fp16_kv else 2e-5, "f16": 2e-3}[cache]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=tol, rtol=tol)


def test_fp16_path_rescales_rows_outside_fp16_range(pa, caches):
    """Rows far above fp16's max (65504) and far below its normal range stay exact after the power-of-two
    rescale: the output matches the reference instead of turning into inf/NaN or losing the small rows."""
    c = caches
    q = c["q"].clone()
    q[0] *= 2.0 ** 20
    q[1] *= 2.0 ** -30
    q[2, :, :3] = 0.0
    q[3] = 0.0
    # The huge row's scores are huge: a small scale keeps its softmax from being one-hot.
    out = pa.launch_paged_attention(q, c["k8"], c["v8"], c["meta"], 2.0 ** -22, c["ks"], c["vs"],
                                    _cfg(16, 1, 1))
    ref = paged_attention_ref(q, c["k8"], c["v8"], c["meta"], 2.0 ** -22, c["ks"], c["vs"])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_decode_configs_keep_the_kv_tiles(pa):
    """Decode and prefill configs of one shape share BLOCK_N (the online-softmax order) and fit the group."""
    for group in (1, 4, 7, 8, 16, 32, 64):
        for d in (64, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                for kv_fp8 in (False, True):
                    pre = pa.attention_tile_config(group, d, dtype, kv_fp8=kv_fp8, decode=False)
                    dec = pa.attention_tile_config(group, d, dtype, kv_fp8=kv_fp8, decode=True)
                    assert pre["BLOCK_N"] == dec["BLOCK_N"] and pre["SWAP"] == dec["SWAP"]
                    assert pre["FP16_KV"] == dec["FP16_KV"] and pre["V_NAT"] == dec["V_NAT"]
                    for key in ("V_CVT", "PREFETCH", "DOT_SUM", "SPLIT"):
                        assert pre[key] == dec[key], key
                    for cfg in (pre, dec):
                        assert cfg["BLOCK_Q"] >= 1 and cfg["BLOCK_Q"] * group <= cfg["BLOCK_M"]
                    if pre["DOT_SUM"]:
                        # warps may differ (no layout-ordered row sum), but both must stay on mma.sync:
                        # wgmma (whole warpgroups, M % 64 == 0) gives other bits
                        for cfg in (pre, dec):
                            assert cfg["num_warps"] % 4 or cfg["BLOCK_M"] % 64, cfg
                        continue
                    assert pre["num_warps"] == dec["num_warps"]
                    if pre["BLOCK_M"] != dec["BLOCK_M"]:   # only where a row's bits cannot tell them apart:
                        # transposed tiles (rows are the MMA's N), or two mma.sync tiles (M % 64 != 0)
                        # narrower than the key tile (warps along the keys)
                        assert pre["SWAP"] or (dec["BLOCK_M"] < pre["BLOCK_M"] < min(64, pre["BLOCK_N"]))

