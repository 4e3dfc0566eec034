"""How far the rowwise FP8 GEMM (kernels/fp8_rowwise.py) lands from a float64 product, by accumulation mode.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python3 benchmarks/fp8_rowwise_accuracy.py                  # the tables' configs, Triton's default
    python3 benchmarks/fp8_rowwise_accuracy.py --imprecise 128  # partial sums promoted every 128 K

For each (M, N, K) it quantizes activations per row (`quantize_rows`, bitwise the reference's quantizer) and
compares the kernel's output with the same quantized operands multiplied in float64 (the GEMM's error
alone), for two kinds of activations:
- `random`: N(0, 1) rows from seeds that share nothing with the weight (what the tests draw);
- `weight rows`: the weight's own rows (dequantized): every diagonal output is a sum of K products of one
  sign, the worst case for an accumulator that drops low bits as the sum grows.
Reported: the largest error relative to the output's magnitude, over all outputs and (for `weight rows`)
on the diagonal. On sm_90 Triton's default `max_num_imprecise_acc` is 2^30 (no promotion of the tensor
core's FP8 partial sums); `--imprecise 128` passes 128, one promotion per K tile.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = "64x4096x4096,64x4096x14336,256x6144x4096"


def _weight(n: int, k: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, device=device, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, torch.rand(n, 1, device=device, generator=gen) * 1e-3 + 1e-4


def _errors(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, imprecise: int) -> dict[str, float]:
    """Relative errors of the kernel's product against float64 on the same quantized operands."""
    from deepinfer.kernels.fp8_row_quant import quantize_rows
    from deepinfer.kernels.fp8_rowwise import fp8_rowwise_linear, rowwise_tile_config
    from deepinfer.kernels.reference.fp8_matmul import fp8_linear_quantized_ref

    m, k = x.shape
    n = w.shape[0]
    cfg = {**rowwise_tile_config(m, n, k), "IMPRECISE_ACC": imprecise}
    out = fp8_rowwise_linear(x, w, s, config=cfg).double()
    xq, xs = quantize_rows(x)
    exact = fp8_linear_quantized_ref(xq, xs, w, s, None, k, torch.float64)   # one K-group: rowwise scales
    signed = (out - exact) / exact.abs().clamp(min=1e-30)
    big = exact.abs() > 0.1 * exact.abs().max()
    res = {"max_rel": float(signed.abs()[big].max())}
    if m <= n:
        d = signed.diagonal()
        res.update(diag_max_rel=float(d.abs().max()), diag_mean_signed=float(d.mean()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imprecise", type=int, default=0, help="IMPRECISE_ACC (0: Triton's default)")
    ap.add_argument("--seeds", type=int, default=20, help="random activation draws per shape")
    ap.add_argument("--shapes", default=SHAPES, help="MxNxK, comma-separated")
    ap.add_argument("--device", default="cuda", help="cpu runs under TRITON_INTERPRET=1 (small shapes)")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        w, s = _weight(n, k, 0, args.device)
        random = [_errors(torch.randn(m, k, device=args.device, dtype=torch.bfloat16,
                                      generator=torch.Generator(device=args.device).manual_seed(1000 + i)),
                          w, s, args.imprecise)["max_rel"] for i in range(args.seeds)]
        rows = (w[:m].float() * s[:m]).to(torch.bfloat16)   # the weight's own rows: one-signed diagonal sums
        own = _errors(rows, w, s, args.imprecise)
        print(json.dumps({"m": m, "n": n, "k": k, "imprecise": args.imprecise,
                          "random_max_rel": round(max(random), 5),
                          "weight_rows": {key: round(v, 5) for key, v in own.items()}}), flush=True)


if __name__ == "__main__":
    main()
