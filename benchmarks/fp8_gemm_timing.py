"""FP8 GEMM timing for benchmarks/bench_fp8.py: kernels timed inside CUDA graphs, arms, the tile sweep.

Timing: `calls` launches captured in one CUDA graph, the graph replayed `replays` times, the median replay
divided by `calls` (back-to-back eager launches would measure Triton's host launch cost, not the kernel).
Weights are random; layers whose FP8 weight fits the H200's 50 MB L2 (o_proj: 16 MB) are partly served from
it across the 20 calls, for every arm alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (64, 256, 2048)
# DeepSeek-V2-Lite routed experts: 64 experts, top-6, hidden 2048, moe_intermediate 1408.
V2_LITE_MOE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}
MOE_TOKENS = (64, 256, 2048)


def graph_time(fn: Callable[[], object], calls: int = 20, replays: int = 5) -> float:
    """Seconds per call of `fn`, timed inside a CUDA graph (see the module docstring)."""
    fn()                                            # compile and warm up outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def _weights(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weight, its block-scaled (128 x 128) and per-channel FP8 forms in the engine's layouts."""
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, quantize_fp8_channel, row_scales

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    wq, inv = quantize_fp8_block(w, (128, 128))
    wc, sc = quantize_fp8_channel(w)
    return {"w": w, "block_q": wq, "block_s": row_scales(inv, n, k, 128, (128, 128)), "block_inv": inv,
            "row_q": wc, "row_s": sc.contiguous(), "row_s_t": sc.reshape(1, n).contiguous()}


def gemm_arms(x: torch.Tensor, wts: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """Every arm on one (layer, M): `*_quant` includes the activation quantization, `*_alone` is the GEMM on
    pre-quantized activations, `quant_*` the quantization alone."""
    from deepinfer.kernels import fp8_matmul as fm
    from deepinfer.kernels import fp8_rowwise as fr
    from deepinfer.kernels.bucket_planner import bucket_for

    m, k = x.shape
    n = wts["w"].shape[0]
    xq_b, xs_b = fm.quantize_act(x, 128)
    xq_r, xs_r = fr.quantize_rows(x)
    block = fm.fp8_tile_config(None, n, k, 128)
    row = fr.rowwise_tile_config(None, n, k)
    # The invariant planner's config for this M where the device proves the buckets equal (kernels/
    # fp8_rowwise.RowwisePlanner), and the single config with pointer loads (before TMA).
    bucket = bucket_for(fr.rowwise_buckets(n, k), m)
    row_ptr = {key: v for key, v in row.items() if key not in ("TMA", "PERSISTENT")}
    bq, bs, rq, rs, rs_t = wts["block_q"], wts["block_s"], wts["row_q"], wts["row_s"], wts["row_s_t"]

    def scaled_mm(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(xq, rq.T, scale_a=xs, scale_b=rs_t, out_dtype=torch.bfloat16)

    arms = {
        "cublas_bf16": lambda: x @ wts["w"].T,
        "scaled_mm_rowwise_alone": lambda: scaled_mm(xq_r, xs_r),
        "scaled_mm_rowwise_quant": lambda: scaled_mm(*fr.quantize_rows(x)),
        "rowwise_det_quant": lambda: fr.fp8_rowwise_linear(x, rq, rs, invariant=True),
        "rowwise_fast_quant": lambda: fr.fp8_rowwise_linear(x, rq, rs, invariant=False),
        "rowwise_det_alone": lambda: fr.rowwise_matmul(xq_r, xs_r, rq, rs, None, x.dtype, row),
        "rowwise_det_ptr_alone": lambda: fr.rowwise_matmul(xq_r, xs_r, rq, rs, None, x.dtype, row_ptr),
        "rowwise_bucket_alone": lambda: fr.rowwise_matmul(xq_r, xs_r, rq, rs, None, x.dtype, bucket),
        "quant_rows": lambda: fr.quantize_rows(x),
        "quant_block": lambda: fm.quantize_act(x, 128),
    }
    from deepinfer.kernels.fp8_block_plan import block_tile_config

    # The block-scaled kernel with the bucket table's config for this M (kernels/fp8_block_plan.py), one
    # weight scale per tile as the engine runs it.
    bucket_b = block_tile_config(m, n, k)
    arms["block_bucket_alone"] = lambda: fm.block_matmul(xq_b, xs_b, bq, bs, None, x.dtype, bucket_b,
                                                         scale_block_n=128)
    for loop in (0, 1, 2):
        cfg = {**block, "K_LOOP": loop}
        arms[f"block_k{loop}_quant"] = lambda cfg=cfg: fm.fp8_linear(x, bq, bs, config=cfg)
        arms[f"block_k{loop}_alone"] = lambda cfg=cfg: fm.block_matmul(xq_b, xs_b, bq, bs, None, x.dtype, cfg)
    return arms


def bench_gemms(layers: dict[str, tuple[int, int]], ms: tuple[int, ...], emit) -> list[dict]:
    """µs per call and TFLOP/s of every arm on every (layer, M); `emit` gets each record."""
    rows = []
    for li, (name, (n, k)) in enumerate(layers.items()):
        wts = _weights(n, k, seed=li)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for arm, fn in gemm_arms(x, wts).items():
                sec = graph_time(fn)
                rec = {"part": "gemm", "layer": name, "n": n, "k": k, "m": m, "arm": arm, "us": sec * 1e6,
                       "tflops": 2.0 * m * n * k / sec / 1e12}
                rows.append(rec)
                emit(rec)
    return rows


def bench_moe(emit) -> list[dict]:
    """DeepSeek-V2-Lite routed experts (whole routed-expert op: sort, both grouped GEMMs, activation,
    combine), FP8 block-scaled (kernels/fp8_moe.py) vs bf16 (kernels/fused_moe.py), invariant and fast."""
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales
    from deepinfer.kernels.fp8_moe import fp8_fused_moe
    from deepinfer.kernels.fused_moe import fused_moe

    e, top_k, h, inter = (V2_LITE_MOE[key] for key in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    gu = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    dn = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    fp8 = []
    for w in (gu, dn):
        q, inv = quantize_fp8_block(w, (128, 128))
        fp8 += [q, torch.stack([row_scales(inv[i], *w.shape[1:], 128, (128, 128)) for i in range(e)])]
    rows = []
    for tokens in MOE_TOKENS:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        scores = torch.rand(tokens, e, device="cuda", generator=gen)
        weights, ids = scores.topk(top_k, dim=1)
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order).contiguous()
        ids = ids.contiguous()
        flops = 2.0 * tokens * top_k * 3 * h * inter
        for inv in (True, False):
            mode = "det" if inv else "fast"
            args = (x, ids, weights)
            arms = {f"bf16_{mode}": lambda a=args, inv=inv: fused_moe(*a, gu, dn, invariant=inv),
                    f"fp8_{mode}": lambda a=args, inv=inv: fp8_fused_moe(*a, *fp8, invariant=inv)}
            for arm, fn in arms.items():
                sec = graph_time(fn)
                rec = {"part": "moe", "tokens": tokens, "arm": arm, "us": sec * 1e6,
                       "tflops": flops / sec / 1e12}
                rows.append(rec)
                emit(rec)
    return rows


def gemm_table(rows: list[dict]) -> str:
    """A markdown table of µs per call: one line per (layer, M), one column per arm."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    out = ["| layer (N×K) | M | " + " | ".join(arms) + " | rowwise det / scaled_mm (alone) |",
           "|---|---|" + "---|" * (len(arms) + 1)]
    keys = list(dict.fromkeys((r["layer"], r["n"], r["k"], r["m"]) for r in rows))
    for layer, n, k, m in keys:
        cell = {r["arm"]: r["us"] for r in rows if (r["layer"], r["m"]) == (layer, m)}
        share = cell.get("scaled_mm_rowwise_alone", 0) / cell["rowwise_det_alone"] \
            if cell.get("rowwise_det_alone") else float("nan")
        cells = " | ".join(f"{cell.get(a, float('nan')):.1f}" for a in arms)
        out.append(f"| {layer} {n}×{k} | {m} | {cells} | {share:.0%} |")
    return "\n".join(out)
