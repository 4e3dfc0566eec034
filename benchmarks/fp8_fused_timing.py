"""Fused FP8 activation quantization timing for benchmarks/bench_fp8.py (kernels/fp8_fused_quant.py).

µs per call inside CUDA graphs (fp8_gemm_timing.graph_time), Llama-3.1-8B widths: residual add + RMSNorm
(H = 4,096, feeding qkv / gate_up) and SiLU-and-mul (I = 14,336, feeding down) at M = 64 / 256 / 2048.
Producer arms: the bf16 op alone (what a bf16 model runs), the op then `quantize_rows` (the unfused FP8
path before the fusion), the fused kernel, and `quantize_rows` alone. Layer arms, producer + its
consumer GEMM: bf16 op + cuBLAS, bf16 op + the deterministic bf16 GEMM (`bi_linear`), op + rowwise FP8
(quantizing inside, deterministic tiles), fused op + rowwise FP8 on its rows (deterministic tiles). The
block-scaled forms (kernels/fp8_group_quant.py, one scale per token and 128-group): the op then
`quantize_act`, the fused group kernel, and the fused group kernel + the block GEMM at the bucket table's
config for M (kernels/fp8_block_plan.py).
"""

from __future__ import annotations

import torch

from benchmarks.fp8_gemm_timing import MS, graph_time

# Producer -> (its row width K, the consumer layer (N, K) it feeds).
PRODUCERS = {"rmsnorm": (4096, ("gate_up", 28672)), "silu_mul": (14336, ("down", 4096))}
ARMS = ("bf16_op", "op_then_quant", "fused_op_quant", "quant_rows", "layer_bf16_cublas", "layer_bf16_det",
        "layer_fp8_unfused", "layer_fp8_fused", "op_then_group_quant", "fused_op_group_quant",
        "layer_block_fused")


def _arms(producer: str, m: int, k: int, n: int) -> dict:
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, quantize_fp8_channel, row_scales
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_block_plan import block_linear_quantized
    from deepinfer.kernels.fp8_fused_quant import rms_norm_quant, silu_and_mul_quant
    from deepinfer.kernels.fp8_group_quant import rms_norm_group_quant, silu_and_mul_group_quant
    from deepinfer.kernels.fp8_matmul import quantize_act
    from deepinfer.kernels.fp8_row_quant import quantize_rows
    from deepinfer.kernels.fp8_rowwise import fp8_rowwise_linear, fp8_rowwise_linear_quantized
    from deepinfer.kernels.matmul import bi_linear
    from deepinfer.kernels.rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(m + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    wq, ws = quantize_fp8_channel(w)
    bq, inv = quantize_fp8_block(w, (128, 128))
    bs = row_scales(inv, n, k, 128, (128, 128))
    if producer == "rmsnorm":
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        nw = torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5

        def op():
            return rms_norm(x, nw, 1e-5, residual=r)[0]

        def fused():
            return rms_norm_quant(x, nw, 1e-5, residual=r)[:2]

        def fused_groups():
            return rms_norm_group_quant(x, nw, 1e-5, 128, residual=r)[:2]
    else:
        x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)

        def op():
            return silu_and_mul(x)

        def fused():
            return silu_and_mul_quant(x)

        def fused_groups():
            return silu_and_mul_group_quant(x, 128)
    y = op()
    return {
        "bf16_op": op,
        "op_then_quant": lambda: quantize_rows(op()),
        "fused_op_quant": fused,
        "quant_rows": lambda: quantize_rows(y),
        "layer_bf16_cublas": lambda: op() @ w.T,
        "layer_bf16_det": lambda: bi_linear(op(), w),
        "layer_fp8_unfused": lambda: fp8_rowwise_linear(op(), wq, ws, invariant=True),
        "layer_fp8_fused": lambda: fp8_rowwise_linear_quantized(*fused(), wq, ws, out_dtype=torch.bfloat16,
                                                                invariant=True),
        "op_then_group_quant": lambda: quantize_act(op(), 128),
        "fused_op_group_quant": fused_groups,
        # invariant=False: the bucket table's config for M with no planner (what a proven table runs).
        "layer_block_fused": lambda: block_linear_quantized(*fused_groups(), bq, bs, out_dtype=torch.bfloat16,
                                                            invariant=False, scale_block_n=128),
    }


def bench_fused_quant(emit, ms: tuple[int, ...] = MS) -> list[dict]:
    """µs per call of every arm for each producer and M; `emit` gets each record."""
    rows = []
    for producer, (k, (layer, n)) in PRODUCERS.items():
        for m in ms:
            for arm, fn in _arms(producer, m, k, n).items():
                rec = {"part": "fused-quant", "producer": producer, "k": k, "layer": layer, "n": n, "m": m,
                       "arm": arm, "us": graph_time(fn) * 1e6}
                rows.append(rec)
                emit(rec)
    return rows


def fused_table(rows: list[dict]) -> str:
    """A markdown table of µs per call: one line per (producer, M), one column per arm."""
    out = ["| producer (K) → layer | M | " + " | ".join(ARMS) + " |", "|---|---|" + "---|" * len(ARMS)]
    for key in dict.fromkeys((r["producer"], r["k"], r["layer"], r["n"], r["m"]) for r in rows):
        producer, k, layer, n, m = key
        cell = {r["arm"]: r["us"] for r in rows if (r["producer"], r["m"]) == (producer, m)}
        cells = " | ".join(f"{cell.get(a, float('nan')):.1f}" for a in ARMS)
        out.append(f"| {producer} ({k}) → {layer} {n}×{k} | {m} | {cells} |")
    return "\n".join(out)
