"""FP8 KV cache kernels vs bf16 (issue 16), timed inside CUDA graphs at the Llama-3.1-8B decode shape.

Run on the GPU machine from the repository root (after `pip install -e .`), about 30 s:
    python3 benchmarks/bench_kv_fp8.py --out kv_fp8.json

Shape: 32 q heads, 8 kv heads, head_dim 128, bf16 activations, 16-token cache blocks (scrambled block
tables), per-head scales that are not powers of two. Timing: benchmarks/fp8_gemm_timing.py's graph_time (20
calls captured in one CUDA graph, median of 5 replays, per call), so Triton's host launch cost is left out
the way the engine's captured decode steps leave it out.
- attention: paged_attention for a decode step of `--batch` sequences with `--context` positions each
  (the CUDA-graph decode plan), over a bf16 cache and over an e4m3 cache; `bf16_same_bytes` is the bf16
  cache at half the context, i.e. the bytes the e4m3 cache reads: e4m3 near it means the fp8 path is
  bandwidth-bound like bf16, e4m3 near bf16 at the full context means the per-tile e4m3 -> bf16 conversion
  (and the shared-memory round trip the converted MMA operand takes) eats the saved bytes. The fp16 arms
  repeat both with fp16 activations, whose e4m3 -> fp16 conversion is one cvt per two elements (bf16 takes
  that cvt and two more, cvt.bf16.f16): e4m3 much faster under fp16 points at the conversion. These arms
  run whatever `attention_tile_config` picks for a decode step; benchmarks/attn_variants.py times the
  kernel's other tile configs side by side.
- rotary + store: one layer's rotate q, rotate k, store k/v for `--batch` decode tokens (and a 2048-token
  prefill chunk): fused (kernels/rotary_store.py, one launch) vs unfused (engine apply_rotary in torch
  ops, then the Triton store_kv / store_kv_fp8), into a bf16 and into an e4m3 cache. Each pair is first
  checked bitwise equal.
`per_step_us` multiplies by the model's 32 layers: what one decode step spends in that op.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_rotary_store import fused, same_bits, unfused  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

HQ, HKV, D, LAYERS = 32, 8, 128, 32   # Llama-3.1-8B
BLOCK_SIZE = 16
DEV = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def _scales(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.rand(HKV, device=DEV, generator=gen) * 0.5 + 0.02,
            torch.rand(HKV, device=DEV, generator=gen) * 0.05 + 0.01)


def _decode_meta(batch: int, context: int, seed: int):
    """Decode-step metadata: `batch` sequences at position context - 1, scrambled blocks, static plan."""
    from deepinfer.kernels.metadata import AttentionMetadata

    per_seq = -(-context // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    blocks = (torch.randperm(batch * per_seq, generator=gen) + 1).view(batch, per_seq).to(torch.int32)
    pos = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = blocks[:, -1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    plan = torch.zeros(2 * batch, dtype=torch.int32)
    plan[0::2] = torch.arange(batch, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots.to(DEV), positions=pos.to(DEV),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEV), block_tables=blocks.to(DEV),
        block_size=BLOCK_SIZE, max_query_len=1, max_seq_len=context, query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch, decode_plan=plan.to(DEV))
    return meta, batch * per_seq + 1


def bench_attention(batch: int, context: int) -> list[dict]:
    """µs per call and GB/s of KV read for the decode attention over bf16 and e4m3 caches."""
    from deepinfer.kernels.paged_attention import paged_attention

    rows = []
    ks, vs = _scales(1)
    scale = D ** -0.5
    fp16 = torch.float16
    for arm, ctx, act, fp8 in (("bf16", context, BF16, False), ("fp8_e4m3", context, BF16, True),
                               ("bf16_same_bytes", context // 2, BF16, False),
                               ("fp16", context, fp16, False), ("fp8_e4m3_fp16_q", context, fp16, True)):
        meta, num_blocks = _decode_meta(batch, ctx, seed=ctx)
        gen = torch.Generator(device=DEV).manual_seed(2)
        q = torch.randn(batch, HQ, D, device=DEV, generator=gen).to(act)
        shape = (num_blocks, BLOCK_SIZE, HKV, D)
        k = torch.randn(shape, device=DEV, generator=gen)
        v = torch.randn(shape, device=DEV, generator=gen)
        if fp8:
            kc = (k / ks.view(1, 1, -1, 1)).clamp(-448, 448).to(FP8)
            vc = (v / vs.view(1, 1, -1, 1)).clamp(-448, 448).to(FP8)

            def fn(q=q, kc=kc, vc=vc, meta=meta):
                return paged_attention(q, kc, vc, meta, scale, ks, vs)
        else:
            kc, vc = k.to(act), v.to(act)

            def fn(q=q, kc=kc, vc=vc, meta=meta):
                return paged_attention(q, kc, vc, meta, scale)
        sec = graph_time(fn)
        kv_bytes = 2 * batch * ctx * HKV * D * kc.element_size()
        rows.append({"part": "attention", "arm": arm, "batch": batch, "context": ctx, "us": sec * 1e6,
                     "kv_gb_per_s": kv_bytes / sec / 1e9, "per_step_us": sec * 1e6 * LAYERS})
        del kc, vc, k, v
    return rows


def _rotary_operands(tokens: int, fp8: bool) -> dict:
    from deepinfer.engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen, device=DEV).to(BF16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    num_blocks = tokens // BLOCK_SIZE + 2
    rope = RotaryEmbedding(D, 16384, 500000.0, None, device=torch.device(DEV))
    cos, sin = rope(torch.randint(0, 16384, (tokens,), generator=gen, device=DEV), BF16)
    dtype = FP8 if fp8 else BF16
    c = dict(q=q.reshape(tokens, HQ, D), k=k.reshape(tokens, HKV, D), v=v.reshape(tokens, HKV, D),
             cos=cos.squeeze(1), sin=sin.squeeze(1),
             k_cache=torch.zeros(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype, device=DEV),
             v_cache=torch.zeros(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype, device=DEV),
             slot_mapping=torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:tokens])
    if fp8:
        c["k_scale"], c["v_scale"] = _scales(3)
    return c


def bench_rotary_store(token_counts: list[int]) -> list[dict]:
    """µs per call of the fused and unfused rotary + store, bf16 and e4m3 caches."""
    rows = []
    for tokens in token_counts:
        for cache, fp8 in (("bf16", False), ("fp8_e4m3", True)):
            c = _rotary_operands(tokens, fp8)
            same = same_bits(c)
            for arm, fn in (("fused", fused), ("unfused", unfused)):
                sec = graph_time(lambda fn=fn, c=c: fn(c))
                rows.append({"part": "rotary_store", "cache": cache, "arm": arm, "tokens": tokens,
                             "us": sec * 1e6, "per_step_us": sec * 1e6 * LAYERS, "bitwise_equal": same})
    return rows


def _print_table(rows: list[dict], cols: list[str]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256, help="decode sequences (attention, rotary tokens)")
    ap.add_argument("--context", type=int, default=640, help="positions per sequence (attention)")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="a prefill chunk for rotary+store")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_fp8.py needs a CUDA GPU")
    attn = bench_attention(args.batch, args.context)
    rot = bench_rotary_store([args.batch, args.prefill_tokens])
    _print_table(attn, ["arm", "batch", "context", "us", "kv_gb_per_s", "per_step_us"])
    print()
    _print_table(rot, ["cache", "arm", "tokens", "us", "per_step_us", "bitwise_equal"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": attn + rot}, f, indent=1)
    if not all(r["bitwise_equal"] for r in rot):
        print("fused and unfused rotary + store differ: see bitwise_equal", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
