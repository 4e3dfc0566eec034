"""Decode attention over a paged KV cache stored token-major ([blocks, block_size, kv_heads, head_dim], the
engine's layout) or head-major (the same view over [blocks, kv_heads, block_size, head_dim] storage, so a
(block, head) tile is one contiguous run), at block sizes 16 / 32 / 64, bf16 and e4m3 caches; and the HBM
read and copy bandwidth of a plain torch reduction and copy of the same bytes, as the measured ceiling.

Run on the GPU machine from the repository root (about 40 s):
    python3 benchmarks/attn_cache_layout.py

The kernel reads the cache through its strides, so both layouts run the same binary on the same values;
each line says whether their outputs are bitwise equal. µs per call in CUDA graphs (fp8_gemm_timing's
graph_time), 256 sequences at position 639 (the throughput benchmark's mid-decode context), scrambled
block tables; Llama-3.1-8B heads (32 q / 8 kv / 128) and Qwen2.5-0.5B heads (14 / 2 / 64).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

DEV = "cuda"
FP8 = torch.float8_e4m3fn
BATCH, CONTEXT = 256, 640


def _meta(batch: int, context: int, block_size: int, seed: int = 1):
    from deepinfer.kernels.metadata import AttentionMetadata

    per_seq = -(-context // block_size)
    gen = torch.Generator().manual_seed(seed)
    blocks = (torch.randperm(batch * per_seq, generator=gen) + 1).view(batch, per_seq).to(torch.int32)
    plan = torch.zeros(2 * batch, dtype=torch.int32)
    plan[0::2] = torch.arange(batch, dtype=torch.int32)
    slots = blocks[:, -1].long() * block_size + (context - 1) % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(DEV), positions=torch.full((batch,), context - 1, device=DEV),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEV), block_tables=blocks.to(DEV),
        block_size=block_size, max_query_len=1, max_seq_len=context, query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch, decode_plan=plan.to(DEV))
    return meta, batch * per_seq + 1


def _cache(values: torch.Tensor, dtype: torch.dtype, head_major: bool) -> torch.Tensor:
    """values [blocks, block_size, heads, dim] in `dtype`, stored token- or head-major (the same view)."""
    if not head_major:
        return values.to(dtype)
    nb, bs, heads, dim = values.shape
    store = torch.empty(nb, heads, bs, dim, dtype=dtype, device=values.device)
    view = store.permute(0, 2, 1, 3)
    view.copy_(values)
    return view


def main() -> int:
    from deepinfer.kernels.paged_attention import paged_attention

    if not torch.cuda.is_available():
        raise SystemExit("attn_cache_layout.py needs a CUDA GPU")
    for hq, hkv, d in ((32, 8, 128), (14, 2, 64)):
        for dtype in (torch.bfloat16, FP8):
            for bs in (16, 32, 64):
                meta, nb = _meta(BATCH, CONTEXT, bs)
                q = torch.randn(BATCH, hq, d, device=DEV).to(torch.bfloat16)
                torch.manual_seed(0)
                k = torch.randn(nb, bs, hkv, d, device=DEV)
                v = torch.randn(nb, bs, hkv, d, device=DEV) * 0.5
                scale = torch.full((hkv,), 0.05, device=DEV) if dtype == FP8 else None
                outs = {}
                for layout in ("token_major", "head_major"):
                    kc, vc = (_cache(t, dtype, layout == "head_major") for t in (k, v))
                    call = functools.partial(paged_attention, q, kc, vc, meta, d ** -0.5, scale, scale)
                    outs[layout] = call()
                    sec = graph_time(call)
                    kv_bytes = 2 * BATCH * CONTEXT * hkv * d * kc.element_size()
                    print(json.dumps({"heads": f"{hq}/{hkv}/{d}", "cache": str(dtype).removeprefix("torch."),
                                      "block_size": bs, "layout": layout, "us": round(sec * 1e6, 1),
                                      "kv_gb_s": round(kv_bytes / sec / 1e9)}), flush=True)
                print("  same bits:", torch.equal(outs["token_major"], outs["head_major"]), flush=True)
    x = torch.empty(2 * BATCH * CONTEXT * 8 * 128, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    read = graph_time(lambda: x.view(torch.int64).sum())
    copy = graph_time(lambda: y.copy_(x))
    print(f"HBM ceiling over {x.numel() / 1e6:.0f} MB: read (int64 sum) {x.numel() / read / 1e9:.0f} GB/s, "
          f"copy {2 * x.numel() / copy / 1e9:.0f} GB/s (read + write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
