"""Make Triton's interpreter treat bfloat16 the way the GPU does, for bf16 kernel tests on CPU.

The interpreter holds bf16 values as their raw uint16 bits. Its `tl.dot` multiplies those bits as integers
(garbage), and its fp32 -> bf16 cast truncates instead of rounding to nearest even. On the GPU a bf16 MMA
multiplies exactly and accumulates in fp32, and casts round to nearest even. `gpu_like_bf16(monkeypatch)`
patches the interpreter's builder to do the same: dot operands widened to fp32 (exact), casts rounded by
torch (round to nearest even). Only bf16 paths change; fp32 kernels run exactly as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch


def _bf16_bits_to_f32(data: np.ndarray) -> np.ndarray:
    bits = torch.from_numpy(np.ascontiguousarray(data).view(np.int16))
    return bits.view(torch.bfloat16).float().numpy()


def _f32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def gpu_like_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch the interpreter (for the monkeypatch's scope) to emulate the GPU's bf16 dot and rounding."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    dot, cast, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def widen(x):
        return handle(_bf16_bits_to_f32(x.data), tl.float32) if x.dtype == tl.bfloat16 else x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def to_bf16(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(_f32_to_bf16_bits(src.data), tl.bfloat16)
        return None

    def cast_impl(self, src, dst_type):
        out = to_bf16(src, dst_type)
        return cast(self, src, dst_type) if out is None else out

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = to_bf16(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "cast_impl", cast_impl)
    monkeypatch.setattr(builder, "create_fp_to_fp", create_fp_to_fp)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def float32_or_gpu_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """The dtype a test runs in: float32, or bfloat16 with the interpreter patched by `gpu_like_bf16`.
    A test module binds it to its own fixture name (`dtype = float32_or_gpu_bf16`)."""
    if request.param == torch.bfloat16:
        gpu_like_bf16(monkeypatch)   # casts round to nearest even, as on the GPU
    return request.param
