"""The rope epilogue's roundings survive compilation (no GPU needed): the qkv GEMM with the epilogue, built
for sm_90 through Triton's own pipeline with the compile options its launch passes
(`rope_kernel_args`), has no fused multiply-add in its PTX. With fusion allowed, LLVM narrows the rounded
products of `rotate_half_rounded` to 16-bit multiplies and fuses one into the sum (fma.rn.bf16), one rounding
fewer than the rotary + KV-store kernel: on the H200 a fifth of q / k elements then differed by an ulp,
which the CPU interpreter (it never fuses) cannot show.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")


def _ptx(options: dict) -> str:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:   # a Triton without the CUDA backend's compiler
        pytest.skip(f"Triton's sm_90 compiler is not importable: {exc}")
    from deepinfer.kernels.matmul import _bi_linear_kernel

    ptrs = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr")
    ints = ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om", "stride_on",
            "stride_cos", "stride_cb", "stride_cs", "stride_ch")
    sig = {**{p: "*bf16" for p in ptrs}, **{i: "i32" for i in ints}, "slot_ptr": "*i64"}
    consts = {k: v for k, v in options.items() if k.isupper()}
    const = dict(HAS_BIAS=True, EVEN_K=True, IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=8,
                 SWIGLU=0, SPLITS=1, K_PER_SPLIT=0, **consts)
    names = list(_bi_linear_kernel.arg_names)
    signature = {n: sig.get(n, "constexpr") for n in names}
    src = ASTSource(fn=_bi_linear_kernel, signature=signature, constexprs=const)
    compile_opts = {k: v for k, v in options.items() if not k.isupper()}
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "num_stages": 2, **compile_opts})
    except Exception as exc:  # noqa: BLE001 - no CUDA toolchain in this Triton build
        if "ptxas" in str(exc) or "backend" in str(exc).lower():
            pytest.skip(f"cannot build for sm_90 here: {str(exc)[:200]}")
        raise
    return kernel.asm["ptx"]


def _rope_options(fusion_override: dict | None = None) -> dict:
    from deepinfer.kernels.reference.rope_layout import RopeStore
    from deepinfer.kernels.rope_epilogue import rope_kernel_args

    d, hq, hkv = 64, 2, 1
    cache = torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16)
    trig = torch.zeros(8, d, dtype=torch.bfloat16)
    store = RopeStore(trig, trig, cache, cache.clone(), torch.zeros(8, dtype=torch.int64), hq, hkv, d)
    _, options = rope_kernel_args(store, torch.empty(8, hq * d, dtype=torch.bfloat16), chunks=1)
    return {**options, **(fusion_override or {})}


FMA = re.compile(r"^\s*fma\.rn\.(?:bf16|f16|f32|ftz)", re.MULTILINE)


def test_the_rope_gemm_compiles_without_fused_multiply_adds():
    ptx = _ptx(_rope_options())
    assert "mul.rn.bf16" in ptx or "cvt.rn.bf16" in ptx, "the epilogue's rounded products are missing"
    assert not FMA.findall(ptx), f"fused multiply-adds in the rope GEMM: {FMA.findall(ptx)[:4]}"


def test_fusion_allowed_would_fuse_a_rounded_product():
    """The detector above sees the hazard it guards against."""
    assert FMA.findall(_ptx(_rope_options({"enable_fp_fusion": True})))
