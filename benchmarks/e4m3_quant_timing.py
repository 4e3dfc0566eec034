"""The activation quantizers' two forms of the e4m3 step on the GPU (kernels/e4m3.py), A/B in one run.

Run on the GPU machine from the repository root (after `pip install -e .`), about a minute:
    python3 benchmarks/e4m3_quant_timing.py [--out e4m3_quant.json]

For each quantizer at Llama-3.1-8B widths and decode / prefill sizes of M: µs per call inside CUDA graphs
(fp8_gemm_timing.graph_time) with the interpreter's form forced on the GPU (`HW=False`: an IEEE division
per element and the e4m3 rounding by integer operations, what every GPU launch ran before) and with the
GPU form (`HW=True`: a reciprocal per scale, two FMAs per element, the hardware cast), the bytes each
call moves over the time (GB/s; the H200's measured read ceiling is ~4,125 GB/s, benchmarks/RESULTS.md),
and whether the two forms and torch's reference give the same bits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import finish_sweep  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

BF16 = torch.bfloat16


class _Forced:
    """A Triton kernel whose launches all get `HW=hw` (what the wrappers pass is `x.is_cuda`)."""

    def __init__(self, kernel, hw: bool) -> None:
        self.kernel, self.hw = kernel, hw

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "HW": self.hw})


@contextlib.contextmanager
def _form(kernels: list[tuple[object, str]], hw: bool) -> Iterator[None]:
    """Within the block, the (module, kernel attribute) pairs launch with HW=hw."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in kernels]
    try:
        for mod, name, kernel in saved:
            setattr(mod, name, _Forced(kernel, hw))
        yield
    finally:
        for mod, name, kernel in saved:
            setattr(mod, name, kernel)


def _cases(m: int) -> dict[str, tuple[Callable, Callable, list, int]]:
    """name -> (run, torch reference, [(module, kernel attribute)], bytes moved per call) at M = m."""
    from deepinfer.kernels import fp8_fused_quant, fp8_group_quant, fp8_matmul, fp8_row_quant, fp8_split_quant
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.reference.fp8_fused_quant import quantize_rows_ref
    from deepinfer.kernels.reference.fp8_matmul import quantize_act_ref
    from deepinfer.kernels.rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(m)
    h, i = 4096, 14336
    x = torch.randn(m, h, device="cuda", generator=gen).to(BF16)
    res = torch.randn(m, h, device="cuda", generator=gen).to(BF16)
    w = (torch.rand(h, device="cuda", generator=gen) + 0.5).to(BF16)
    gu = torch.randn(m, 2 * i, device="cuda", generator=gen).to(BF16)
    split = [(fp8_split_quant, "_chunk_cast_kernel")]
    silu_kernels = split if fp8_split_quant.use_split(gu) else [(fp8_fused_quant, "_silu_mul_quant_kernel")]
    return {
        "rows K=4096": (lambda: fp8_row_quant.quantize_rows(x), lambda: quantize_rows_ref(x),
                        [(fp8_row_quant, "_row_quant_kernel")], m * h * 3),
        "rmsnorm+res+quant H=4096": (
            lambda: fp8_fused_quant.rms_norm_quant(x, w, 1e-5, res)[:2],
            lambda: quantize_rows_ref(rms_norm(x, w, 1e-5, residual=res)[0]),
            [(fp8_fused_quant, "_rms_norm_quant_kernel")], m * h * 7),
        "silu_mul+quant I=14336": (lambda: fp8_fused_quant.silu_and_mul_quant(gu),
                                   lambda: quantize_rows_ref(silu_and_mul(gu)), silu_kernels, m * i * 5),
        "groups K=4096": (lambda: fp8_matmul.quantize_act(x, 128), lambda: quantize_act_ref(x, 128),
                          [(fp8_matmul, "_act_quant_kernel")], m * h * 3),
        "silu_mul+group quant I=14336": (
            lambda: fp8_group_quant.silu_and_mul_group_quant(gu, 128),
            lambda: quantize_act_ref(silu_and_mul(gu), 128),
            [(fp8_group_quant, "_silu_mul_group_quant_kernel")], m * i * 5),
    }


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="256,2048,16384", help="comma-separated row counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("e4m3_quant_timing.py needs a CUDA GPU")
    start = time.time()
    rows = []
    for m in map(int, args.m.split(",")):
        for name, (run, ref, kernels, nbytes) in _cases(m).items():
            row = {"op": name, "m": m}
            with _form(kernels, hw=False):
                old = run()
                row["interpreter_form_us"] = graph_time(run) * 1e6
            with _form(kernels, hw=True):
                new = run()
                row["gpu_form_us"] = graph_time(run) * 1e6
            want = ref()
            row.update(same_bits=_same(old, new), torch_bits=_same(new, want),
                       speedup=row["interpreter_form_us"] / row["gpu_form_us"],
                       gpu_form_gb_s=nbytes / row["gpu_form_us"] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = ["op", "m", "interpreter_form_us", "gpu_form_us", "speedup", "gpu_form_gb_s", "same_bits",
            "torch_bits"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return finish_sweep(rows, args.out, start)


if __name__ == "__main__":
    raise SystemExit(main())
