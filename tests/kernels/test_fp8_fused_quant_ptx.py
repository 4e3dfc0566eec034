"""The fused RMSNorm -> FP8 kernels (per row: kernels/fp8_fused_quant.py; per K-group:
kernels/fp8_group_quant.py) compute rstd exactly as kernels/rmsnorm.py does, checked on the CPU in the
sm_90 PTX Triton compiles for each (no GPU needed): the expression tree of the `rsqrt` operand, each PTX
register replaced by the instruction that defines it, is the same in both kernels (same layout, same
order of the sum, the same products and no FMA contraction), for several H, with and without residual.
tests/kernels/test_fp8_fused_quant_gpu.py checks the resulting bits on the device."""

from __future__ import annotations

import functools
import re

import pytest

triton = pytest.importorskip("triton")


def _launch(monkeypatch, kernel, call) -> dict:
    """The keyword arguments `call()` launches `kernel` with (captured, nothing runs)."""
    seen: dict = {}
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: seen.update(kwargs))
    call()
    assert seen, "the kernel was not launched"
    return seen


def _compile_ptx(fn, args: list[tuple[str, str, int | None]], launch: dict) -> str:
    """PTX of `fn` for sm_90 with the constexprs and options of a real launch; args: (name, type, value or
    None), pointers and values divisible by 16 with Triton's divisibility hint, as such a launch gets."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = {name for name, _, _ in args}
    # Constexprs the launch left at their defaults (PDL off the GPU): newer Triton does not fill them in.
    defaults = {p.name: p.default for p in inspect.signature(fn.fn).parameters.values()
                if p.default is not inspect.Parameter.empty and p.name not in names}
    constexprs = defaults | {k: v for k, v in launch.items() if k not in names and k.isupper()}
    options = {"num_warps": launch["num_warps"], "enable_fp_fusion": launch.get("enable_fp_fusion", True)}
    sig = {name: typ for name, typ, _ in args} | {k: "constexpr" for k in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, typ, v) in enumerate(args)
             if typ.startswith("*") or (v and v % 16 == 0)}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # noqa: BLE001 - a Triton install without the CUDA backend / ptxas
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return kernel.asm["ptx"]


def _split(s: str) -> list[str]:
    depth, parts, cur = 0, [], ""
    for ch in s:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


@functools.cache
def _simplify(e: str) -> str:
    """Lane bookkeeping out of the way: part_i(pack(a, b)) -> the lane; part_i(add.bf16x2(x, y)) -> a
    lane-wise add.rn.bf16 of the parts (what bf16x2 computes per lane)."""
    m = re.match(r"^([\w.]+)\((.*)\)$", e, re.S)
    if not m:
        return e
    op, args = m.group(1), [_simplify(a) for a in _split(m.group(2))] if m.group(2) else []
    if op.startswith("part") and args and args[0].startswith("pack("):
        return _split(args[0][5:-1])[int(op[4:])]
    if op.startswith("part") and args and args[0].startswith("add.rn.bf16x2("):
        x, y = _split(args[0][len("add.rn.bf16x2("):-1])
        return _simplify(f"add.rn.bf16(part{op[4:]}({x}),part{op[4:]}({y}))")
    return f"{op}({','.join(args)})"


def _rsqrt_operand(ptx: str) -> str:
    """The expression of the first rsqrt's result: loads named by their order and lane, kernel parameters
    anonymised, shared-memory round trips kept as SH(...)."""
    env: dict[str, str] = {}
    loads = 0
    for raw in ptx.splitlines():
        line = re.sub(r"^@!?%p\d+\s+", "", raw.strip()).rstrip(";")
        if not line or line.startswith(("//", ".", "$")) or line.endswith(":") or " " not in line:
            continue
        op, rest = line.split(None, 1)
        rest = rest.strip()
        if op.startswith("ld.global"):
            m = re.match(r"\{([^}]*)\}", rest)
            regs = [r.strip() for r in m.group(1).split(",")] if m else [rest.split(",")[0].strip()]
            env.update({r: f"L{loads}[{i}]" for i, r in enumerate(regs)})
            loads += 1
        elif op.startswith("st.shared"):
            env["SHMEM"] = env.get(rest.split(",")[-1].strip(), "?")
        elif op.startswith("ld.shared"):
            env[rest.split(",")[0].strip()] = f"SH({env.get('SHMEM', '?')})"
        elif op.startswith(("st.", "bar", "ret", "bra")):
            continue
        elif op.startswith("mov") and (m := re.match(r"(\S+),\s*\{([^}]*)\}", rest)):
            lanes = [env.get(x.strip(), x.strip()) for x in m.group(2).split(",")]
            env[m.group(1)] = f"pack({','.join(lanes)})"
        elif op.startswith("mov") and (m := re.match(r"\{([^}]*)\},\s*(\S+)", rest)):
            src = env.get(m.group(2), m.group(2))
            env.update({r.strip(): f"part{i}({src})" for i, r in enumerate(m.group(1).split(","))})
        else:
            dst, *srcs = [a.strip() for a in rest.split(",")]
            val = f"{op}({','.join(env.get(s, s) for s in srcs)})"
            env[dst] = re.sub(r"_rms_norm(_quant|_group_quant)?_kernel_param_\d+", "P", val)
            if op.startswith("rsqrt"):
                return _simplify(env[dst])
    raise AssertionError("no rsqrt in the PTX")


@pytest.mark.parametrize("h", [4096, 3584, 896, 100])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("form", ["rows", "groups"])
@pytest.mark.parametrize("hw", [False, True], ids=["interpreter_form", "gpu_form"])
def test_fused_norm_rstd_is_rmsnorm_rstd_in_ptx(monkeypatch, h, with_residual, form, hw):
    import torch
    from deepinfer.kernels import fp8_fused_quant, fp8_group_quant, rmsnorm

    x, w = torch.zeros(2, h, dtype=torch.bfloat16), torch.ones(h, dtype=torch.bfloat16)
    r = torch.zeros_like(x) if with_residual else None
    plain_launch = _launch(monkeypatch, rmsnorm._rms_norm_kernel, lambda: rmsnorm.rms_norm(x, w, 1e-5, r))
    r_stride = h if with_residual else 0
    head = [("x_ptr", "*bf16", None), ("r_ptr", "*bf16", None), ("w_ptr", "*bf16", None),
            ("q_ptr", "*fp8e4nv", None), ("s_ptr", "*fp32", None), ("res_out_ptr", "*bf16", None),
            ("H", "i32", h), ("eps", "fp32", None), ("stride_x", "i32", h), ("stride_r", "i32", r_stride),
            ("stride_q", "i32", h)]
    if form == "rows":
        kernel, args = fp8_fused_quant._rms_norm_quant_kernel, [*head, ("stride_res_out", "i32", r_stride)]
        fused_launch = _launch(monkeypatch, kernel, lambda: fp8_fused_quant.rms_norm_quant(x, w, 1e-5, r))
    else:   # the group form also stores [M, H / 128] scales
        kernel = fp8_group_quant._rms_norm_group_quant_kernel
        args = [*head, ("stride_s", "i32", -(-h // 128)), ("stride_res_out", "i32", r_stride)]
        fused_launch = _launch(monkeypatch, kernel,
                               lambda: fp8_group_quant.rms_norm_group_quant(x, w, 1e-5, 128, r))
    assert plain_launch["num_warps"] == fused_launch["num_warps"]
    fused_launch = dict(fused_launch, HW=hw)   # kernels/e4m3.py: the quantization step's two forms
    plain = _compile_ptx(rmsnorm._rms_norm_kernel, [
        ("x_ptr", "*bf16", None), ("r_ptr", "*bf16", None), ("w_ptr", "*bf16", None),
        ("out_ptr", "*bf16", None), ("res_out_ptr", "*bf16", None), ("xb_ptr", "*bf16", None),
        ("H", "i32", h), ("eps", "fp32", None), ("split_stride", "i32", 0), ("stride_x", "i32", h),
        ("stride_r", "i32", r_stride), ("stride_out", "i32", h),
        ("stride_res_out", "i32", h)], plain_launch)
    fused = _compile_ptx(kernel, args, fused_launch)
    a, b = _rsqrt_operand(plain), _rsqrt_operand(fused)
    assert a.count("mul") >= min(h, 128) // 32   # the squares are in the tree
    same = a == b   # compared outside the assert: pytest's diff of two huge strings would take minutes
    at = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    assert same, f"rstd differs at {at}:\n{a[max(0, at - 200):at + 100]}\n{b[max(0, at - 200):at + 100]}"


@pytest.mark.parametrize("op,width", [("silu", 14336), ("rows", 4096)])
def test_split_quant_kernels_compile_with_wide_loads(monkeypatch, op, width):
    """kernels/fp8_split_quant.py's two kernels, at a decode step's real launch (M = 256, Llama-3.1-8B
    widths), compile for sm_90 with 16-byte input loads and the IEEE division of e4m3_quotient's
    interpreter form."""
    import torch
    from deepinfer.kernels import fp8_fused_quant, fp8_row_quant, fp8_split_quant

    cols = 2 * width if op == "silu" else width
    x = torch.zeros(256, cols, dtype=torch.bfloat16)
    run = (lambda: fp8_fused_quant.silu_and_mul_quant(x)) if op == "silu" else (
        lambda: fp8_row_quant.quantize_rows(x, split=fp8_split_quant.SPLIT_BLOCK))  # forced: not its default
    amax_launch: dict = {}
    monkeypatch.setattr(fp8_split_quant._chunk_amax_kernel, "run", lambda *a, **kw: amax_launch.update(kw))
    cast_launch = _launch(monkeypatch, fp8_split_quant._chunk_cast_kernel, run)   # both launches captured
    assert amax_launch["SWIGLU"] == (op == "silu") and amax_launch["BLOCK"] == fp8_split_quant.SPLIT_BLOCK
    common = [("M", "i32", 256), ("N_COLS", "i32", width), ("stride_x", "i32", cols)]
    amax = _compile_ptx(fp8_split_quant._chunk_amax_kernel, [
        ("x_ptr", "*bf16", None), ("amax_ptr", "*fp32", None), *common], amax_launch)
    cast = _compile_ptx(fp8_split_quant._chunk_cast_kernel, [
        ("x_ptr", "*bf16", None), ("amax_ptr", "*fp32", None), ("q_ptr", "*fp8e4nv", None),
        ("s_ptr", "*fp32", None), *common, ("stride_q", "i32", width)], cast_launch)
    assert "ld.global.v4" in amax and "ld.global.v4" in cast
    assert "div.rn.f32" in cast


_PTR_TYPES = {"torch.bfloat16": "*bf16", "torch.float8_e4m3fn": "*fp8e4nv", "torch.float32": "*fp32"}


def _ptx_of_launch(monkeypatch, kernel, call, silence=(), **override) -> str:
    """sm_90 PTX of `kernel` as `call()` launches it (positional arguments typed from the captured values:
    tensors by dtype, ints as i32, floats as fp32), its keyword constexprs updated by `override`; the
    kernels in `silence` are launched by `call` too and ignored."""
    seen: dict = {}
    for other in silence:
        monkeypatch.setattr(other, "run", lambda *args, **kwargs: None)

    def capture(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)

    monkeypatch.setattr(kernel, "run", capture)
    call()
    assert seen, "the kernel was not launched"
    specs = []
    for name, value in zip(kernel.arg_names, seen["args"], strict=False):
        if hasattr(value, "dtype"):
            specs.append((name, _PTR_TYPES[str(value.dtype)], None))
        elif isinstance(value, float):
            specs.append((name, "fp32", None))
        else:
            specs.append((name, "i32", int(value)))
    return _compile_ptx(kernel, specs, {**seen["kwargs"], **override})


def _quantizer_launches():
    """(kernel, call, other kernels the call launches) of every activation quantizer at a launch the
    engine makes (CPU tensors: only the launch is captured)."""
    import torch
    from deepinfer.kernels import fp8_fused_quant, fp8_group_quant, fp8_matmul, fp8_row_quant, fp8_split_quant

    bf16 = torch.bfloat16
    x4k, w = torch.zeros(256, 4096, dtype=bf16), torch.ones(4096, dtype=bf16)
    swiglu = torch.zeros(1024, 2 * 14336, dtype=bf16)    # prefill-sized: the one-program kernel
    return {
        "rows": (fp8_row_quant._row_quant_kernel, lambda: fp8_row_quant.quantize_rows(x4k)),
        "rms_rows": (fp8_fused_quant._rms_norm_quant_kernel,
                     lambda: fp8_fused_quant.rms_norm_quant(x4k, w, 1e-5)),
        "silu_rows": (fp8_fused_quant._silu_mul_quant_kernel,
                      lambda: fp8_fused_quant.silu_and_mul_quant(swiglu)),
        "silu_split": (fp8_split_quant._chunk_cast_kernel,
                       lambda: fp8_fused_quant.silu_and_mul_quant(swiglu[:64]),
                       fp8_split_quant._chunk_amax_kernel),
        "groups": (fp8_matmul._act_quant_kernel, lambda: fp8_matmul.quantize_act(x4k, 128)),
        "rms_groups": (fp8_group_quant._rms_norm_group_quant_kernel,
                       lambda: fp8_group_quant.rms_norm_group_quant(x4k, w, 1e-5, 128)),
        "silu_groups": (fp8_group_quant._silu_mul_group_quant_kernel,
                        lambda: fp8_group_quant.silu_and_mul_group_quant(swiglu[:64, :2816], 128)),
    }


@pytest.mark.parametrize("name", ["rows", "rms_rows", "silu_rows", "silu_split", "groups", "rms_groups",
                                  "silu_groups"])
def test_gpu_form_of_the_quantizers_divides_once_per_scale_and_rounds_in_the_cast(monkeypatch, name):
    """kernels/e4m3.py: on the GPU (HW) every quantizer takes its quotients from a reciprocal and two FMAs
    and leaves the e4m3 rounding to the hardware cast, the interpreter form (what a CPU launch passes)
    divides per element; tests/kernels/test_fp8_fused_quant_gpu.py checks that the bits are torch's."""
    kernel, call, *silence = _quantizer_launches()[name]
    cpu = _ptx_of_launch(monkeypatch, kernel, call, silence)
    gpu = _ptx_of_launch(monkeypatch, kernel, call, silence, HW=True)
    assert "cvt.rn.satfinite.e4m3x2.f32" in gpu and "fma.rn.f32" in gpu
    per_element, per_scale = cpu.count("div.rn.f32"), gpu.count("div.rn.f32")
    assert per_scale >= 1 and 4 * per_scale <= per_element, (per_scale, per_element)
