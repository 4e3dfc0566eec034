"""Kernel micro-benchmarks on one CUDA GPU: deepinfer's batch-invariant Triton kernels vs torch peers.

Run on the GPU machine from the repository root (after `pip install -e .`):
    python benchmarks/bench_kernels.py --out kernels.json            # all sections, a few minutes
    python benchmarks/bench_kernels.py --out kernels.json --sweep    # plus alternative GEMM tile configs
    python benchmarks/bench_kernels.py --only gemm --m 1 256 4096   # a subset

Timing: triton.testing.do_bench, median over repeated runs (Triton flushes L2 between runs).
- gemm: bi_linear vs cuBLAS (torch.nn.functional.linear) on Llama-3.1-8B linear shapes, bf16: TFLOP/s, share
  of the 780 TFLOP/s bf16 ceiling measured on the H200, GB/s (what matters for small M), time ratio to cuBLAS.
- rmsnorm (fused residual add) and silu_and_mul vs eager torch written as Hugging Face does: GB/s.
- attention: paged prefill (TFLOP/s, causal FLOPs) and decode (GB/s of KV read) vs torch SDPA on contiguous,
  unpaged tensors (the peer gets the easier layout; K/V heads expanded for its flash path, and for decode
  also SDPA's own GQA path when available — the faster of the two is the peer).
Each section's failure is recorded in the JSON instead of aborting the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

CEILING_TFLOPS = 780.0          # bf16 dense matmul measured on the H200 (shared GPU notes)
CEILING_GBPS = 4200.0           # device-to-device copy measured on the H200
LINEAR_SHAPES = {               # Llama-3.1-8B: name -> (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
ATTENTION_HEADS = (32, 8, 128, 16)                           # Llama-3.1-8B: Hq, Hkv, head_dim; block size
PREFILL_CASES = ((16, 512), (4, 2048), (256, 512))          # (sequences, prompt length)
DECODE_CASES = ((1, 2048), (64, 512), (256, 512), (256, 2048))  # (sequences, context length)
DEV = "cuda"
BF16 = torch.bfloat16


def _ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(BF16)


def _table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------------------------- GEMM

def bench_gemm(ms: list[int]) -> list[dict]:
    from deepinfer.kernels.matmul import bi_linear, matmul_config

    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        w = _randn(n, k, scale=k ** -0.5, seed=1)
        for m in ms:
            x = _randn(m, k, seed=2)
            diff = (bi_linear(x, w).float() - F.linear(x, w).float()).abs().max().item()
            t_bi = _ms(lambda x=x, w=w: bi_linear(x, w))
            t_cb = _ms(lambda x=x, w=w: F.linear(x, w))
            flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + n * k + m * n)
            cfg = matmul_config(n, k, BF16)
            rows.append({
                "layer": name, "M": m, "N": n, "K": k,
                "tile": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}",
                "bi_ms": t_bi, "cublas_ms": t_cb,
                "bi_TFLOPs": flops / t_bi / 1e9, "cublas_TFLOPs": flops / t_cb / 1e9,
                "bi_pct_ceiling": 100.0 * flops / t_bi / 1e9 / CEILING_TFLOPS,
                "bi_GBps": nbytes / t_bi / 1e6, "cublas_GBps": nbytes / t_cb / 1e6,
                "time_ratio_vs_cublas": t_bi / t_cb, "max_abs_diff_vs_cublas": diff,
            })
    _table("bi_linear vs cuBLAS (bf16)", rows,
           ["layer", "M", "N", "K", "tile", "bi_ms", "cublas_ms", "bi_TFLOPs", "bi_pct_ceiling",
            "cublas_TFLOPs", "bi_GBps", "time_ratio_vs_cublas"])
    return rows


def bench_gemm_sweep(ms: list[int]) -> list[dict]:
    """Alternative tile configs: each is batch-invariant by itself, so any one may become the default."""
    from deepinfer.kernels.matmul import MatmulConfig, bi_linear

    configs = {
        "128x128x64 w8 s4 persistent": MatmulConfig(128, 128, 64, num_warps=8, num_stages=4),
        "128x128x64 w8 s4 grid": MatmulConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=False),
        "128x256x64 w8 s3 persistent": MatmulConfig(128, 256, 64, num_warps=8, num_stages=3),
        "128x256x64 w8 s3 grid": MatmulConfig(128, 256, 64, num_warps=8, num_stages=3, persistent=False),
        "128x128x64 w4 s4 persistent": MatmulConfig(128, 128, 64, num_warps=4, num_stages=4),
        "64x128x64 w4 s4 persistent": MatmulConfig(64, 128, 64, num_warps=4, num_stages=4),
        "64x256x64 w4 s4 grid": MatmulConfig(64, 256, 64, num_warps=4, num_stages=4, persistent=False),
        "128x128x128 w8 s3 persistent": MatmulConfig(128, 128, 128, num_warps=8, num_stages=3),
    }
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        w = _randn(n, k, scale=k ** -0.5, seed=1)
        for m in ms:
            x = _randn(m, k, seed=2)
            flops = 2.0 * m * n * k
            t_cb = _ms(lambda x=x, w=w: F.linear(x, w))
            for cname, cfg in configs.items():
                row = {"layer": name, "M": m, "config": cname}
                try:
                    t = _ms(lambda x=x, w=w, cfg=cfg: bi_linear(x, w, config=cfg))
                    row.update(ms=t, TFLOPs=flops / t / 1e9, time_ratio_vs_cublas=t / t_cb)
                except Exception as e:  # a config may not fit in shared memory / registers
                    row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
    _table("bi_linear tile-config sweep (bf16)", rows,
           ["layer", "M", "config", "ms", "TFLOPs", "time_ratio_vs_cublas", "error"])
    return rows


# ------------------------------------------------------------------------------------ norm, activation

def bench_pointwise(ms: list[int]) -> list[dict]:
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.reference.activation import silu_and_mul_ref
    from deepinfer.kernels.reference.rmsnorm import rms_norm_ref
    from deepinfer.kernels.rmsnorm import rms_norm

    rows = []
    h, inter = 4096, 14336
    w = _randn(h, seed=3)
    for m in ms:
        x, r = _randn(m, h, seed=4), _randn(m, h, seed=5)
        nbytes = 2.0 * (4 * m * h + h)
        t_k = _ms(lambda x=x, r=r: rms_norm(x, w, 1e-5, r))
        t_t = _ms(lambda x=x, r=r: rms_norm_ref(x, w, 1e-5, r))
        rows.append({"op": "add+rms_norm", "M": m, "H": h, "kernel_ms": t_k, "torch_ms": t_t,
                     "kernel_GBps": nbytes / t_k / 1e6, "torch_GBps": nbytes / t_t / 1e6,
                     "kernel_pct_bw": 100.0 * nbytes / t_k / 1e6 / CEILING_GBPS})
        g = _randn(m, 2 * inter, seed=6)
        nbytes = 2.0 * 3 * m * inter
        t_k = _ms(lambda g=g: silu_and_mul(g))
        t_t = _ms(lambda g=g: silu_and_mul_ref(g))
        rows.append({"op": "silu_and_mul", "M": m, "H": inter, "kernel_ms": t_k, "torch_ms": t_t,
                     "kernel_GBps": nbytes / t_k / 1e6, "torch_GBps": nbytes / t_t / 1e6,
                     "kernel_pct_bw": 100.0 * nbytes / t_k / 1e6 / CEILING_GBPS})
    _table("rms_norm / silu_and_mul (bf16)", rows,
           ["op", "M", "H", "kernel_ms", "torch_ms", "kernel_GBps", "torch_GBps", "kernel_pct_bw"])
    return rows


# ----------------------------------------------------------------------------------------- attention

def _paged_setup(lens: list[int], hq: int, hkv: int, d: int, block_size: int):
    from deepinfer.kernels.paged_attention import store_kv

    from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

    blocks, num_blocks = random_block_lists(lens, block_size, seed=0)
    total = sum(lens)
    k, v = _randn(total, hkv, d, seed=7), _randn(total, hkv, d, seed=8)
    k_cache = torch.zeros((num_blocks, block_size, hkv, d), dtype=BF16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], block_size, DEV)
    store_kv(k, v, k_cache, v_cache, fill.slot_mapping)
    return blocks, k, v, k_cache, v_cache


def _expand_heads(kv: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hq, L, D], so SDPA takes its flash path without GQA support."""
    return kv.repeat_interleave(num_q_heads // kv.shape[1], dim=1).contiguous()


def _sdpa_gqa_ms(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> float | None:
    """SDPA with enable_gqa (K/V not expanded) when this torch accepts it, else None."""
    try:
        F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
    except (TypeError, RuntimeError):
        return None
    return _ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True))


def bench_attention() -> list[dict]:
    from deepinfer.kernels.paged_attention import paged_attention

    from tests.support.paged_batches import SeqStep, build_metadata

    hq, hkv, d, bs = ATTENTION_HEADS
    scale = d ** -0.5
    rows = []
    for num_seqs, length in PREFILL_CASES:
        lens = [length] * num_seqs
        blocks, k, v, k_cache, v_cache = _paged_setup(lens, hq, hkv, d, bs)
        meta = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], bs, DEV)
        q = _randn(sum(lens), hq, d, seed=9)
        flops = 4.0 * d * hq * num_seqs * length * (length + 1) / 2
        t_k = _ms(lambda q=q, meta=meta, kc=k_cache, vc=v_cache: paged_attention(q, kc, vc, meta, scale))
        qb = q.view(num_seqs, length, hq, d).transpose(1, 2).contiguous()
        kb = _expand_heads(k.view(num_seqs, length, hkv, d).transpose(1, 2), hq)
        vb = _expand_heads(v.view(num_seqs, length, hkv, d).transpose(1, 2), hq)
        t_p = _ms(lambda qb=qb, kb=kb, vb=vb: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True))
        rows.append({"phase": "prefill", "seqs": num_seqs, "context": length, "kernel_ms": t_k,
                     "sdpa_ms": t_p, "kernel_TFLOPs": flops / t_k / 1e9, "sdpa_TFLOPs": flops / t_p / 1e9,
                     "time_ratio_vs_sdpa": t_k / t_p})
        del blocks, k, v, k_cache, v_cache, meta, q, qb, kb, vb
        torch.cuda.empty_cache()
    for num_seqs, length in DECODE_CASES:
        lens = [length] * num_seqs
        blocks, k, v, k_cache, v_cache = _paged_setup(lens, hq, hkv, d, bs)
        meta = build_metadata([SeqStep(blocks[b], n, 1) for b, n in enumerate(lens)], bs, DEV)
        q = _randn(num_seqs, hq, d, seed=10)
        nbytes = 2.0 * 2 * num_seqs * length * hkv * d
        t_k = _ms(lambda q=q, meta=meta, kc=k_cache, vc=v_cache: paged_attention(q, kc, vc, meta, scale))
        qb = q.view(num_seqs, 1, hq, d).transpose(1, 2).contiguous()
        kb = k.view(num_seqs, length, hkv, d).transpose(1, 2).contiguous()
        vb = v.view(num_seqs, length, hkv, d).transpose(1, 2).contiguous()
        t_gqa = _sdpa_gqa_ms(qb, kb, vb)
        kx, vx = _expand_heads(kb, hq), _expand_heads(vb, hq)
        t_x = _ms(lambda qb=qb, kx=kx, vx=vx: F.scaled_dot_product_attention(qb, kx, vx))
        t_p = min(t for t in (t_gqa, t_x) if t is not None)
        del kx, vx
        rows.append({"phase": "decode", "seqs": num_seqs, "context": length, "kernel_ms": t_k,
                     "sdpa_ms": t_p, "kernel_GBps": nbytes / t_k / 1e6, "sdpa_GBps": nbytes / t_p / 1e6,
                     "kernel_pct_bw": 100.0 * nbytes / t_k / 1e6 / CEILING_GBPS,
                     "sdpa_gqa_ms": t_gqa, "sdpa_expanded_ms": t_x, "time_ratio_vs_sdpa": t_k / t_p})
        del blocks, k, v, k_cache, v_cache, meta, q, qb, kb, vb
        torch.cuda.empty_cache()
    _table(f"paged_attention vs torch SDPA (bf16, {hq}/{hkv} heads, head_dim {d}, block {bs})", rows,
           ["phase", "seqs", "context", "kernel_ms", "sdpa_ms", "kernel_TFLOPs", "sdpa_TFLOPs",
            "kernel_GBps", "sdpa_GBps", "kernel_pct_bw", "time_ratio_vs_sdpa"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 64, 256, 4096], help="token counts M")
    parser.add_argument("--only", nargs="+", choices=["gemm", "pointwise", "attention"],
                        default=["gemm", "pointwise", "attention"])
    parser.add_argument("--sweep", action="store_true", help="also time alternative GEMM tile configs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    import triton

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "ceiling_tflops": CEILING_TFLOPS, "ceiling_gbps": CEILING_GBPS, "M": args.m,
        "sections": {}, "errors": {},
    }
    sections: dict[str, Callable[[], list[dict]]] = {
        "gemm": lambda: bench_gemm(args.m),
        "pointwise": lambda: bench_pointwise(args.m),
        "attention": bench_attention,
    }
    if args.sweep:
        args.only.append("gemm_sweep")
        sections["gemm_sweep"] = lambda: bench_gemm_sweep(args.m)
    for name in args.only:
        try:
            result["sections"][name] = sections[name]()
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(f"\n{name}: FAILED\n{result['errors'][name]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
