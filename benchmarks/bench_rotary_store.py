"""Fused rotary + KV-cache store (kernels/rotary_store.py) vs today's unfused path, on one CUDA GPU.

Run on the GPU machine from the repository root (after `pip install -e .`), about a minute:
    python benchmarks/bench_rotary_store.py --out rotary_store.json

Unfused = what the attention layer ran before: apply_rotary(q), apply_rotary(k) in the model dtype (each:
neg, cat, 2 mul, add) and the Triton store_kv. Both arms get the same bf16 operands (q/k/v as views of a
merged qkv projection, cos/sin rows from the engine's rotary table, 16-token cache blocks), and the script
first checks that the two give bitwise the same q and caches.
- device_us: triton.testing.do_bench median of one call (GPU time; L2 flushed between runs).
- step_us: median wall time of `layers` back-to-back calls followed by one synchronize: what one decode
  step pays for this op across the model's layers, launch overhead included (what the host-bound 0.5B
  shape feels).
End-to-end A/B: bench_throughput.py with and without DEEPINFER_DISABLE_FUSED_ROPE=1.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {  # name -> (Hq, Hkv, head_dim, rope theta, layers)
    "llama-3.1-8b": (32, 8, 128, 500000.0, 32),
    "qwen2.5-0.5b": (14, 2, 64, 1000000.0, 24),
}
TOKENS = (1, 64, 256, 2048, 8192)
DEV = "cuda"
BF16 = torch.bfloat16


def _operands(hq: int, hkv: int, d: int, theta: float, tokens: int) -> dict:
    from deepinfer.engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen, device=DEV).to(BF16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    block_size = 16
    num_blocks = tokens // block_size + 2
    rope = RotaryEmbedding(d, 16384, theta, None, device=torch.device(DEV))
    cos, sin = rope(torch.randint(0, 16384, (tokens,), generator=gen, device=DEV), BF16)
    return dict(q=q.reshape(tokens, hq, d), k=k.reshape(tokens, hkv, d), v=v.reshape(tokens, hkv, d),
                cos=cos.squeeze(1), sin=sin.squeeze(1),
                k_cache=torch.zeros(num_blocks, block_size, hkv, d, dtype=BF16, device=DEV),
                v_cache=torch.zeros(num_blocks, block_size, hkv, d, dtype=BF16, device=DEV),
                slot_mapping=torch.randperm(num_blocks * block_size, device=DEV)[:tokens])


def unfused(c: dict) -> torch.Tensor:
    """The unfused composition: engine apply_rotary on q and k (torch ops), then the Triton store (the e4m3
    store when `c` carries k_scale / v_scale)."""
    from deepinfer.engine.layers.rotary import apply_rotary
    from deepinfer.kernels.kv_fp8 import store_kv_fp8
    from deepinfer.kernels.store_kv import store_kv

    cos, sin = c["cos"][:, None], c["sin"][:, None]
    q, k = apply_rotary(c["q"], cos, sin), apply_rotary(c["k"], cos, sin)
    if "k_scale" in c:
        store_kv_fp8(k, c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"])
    else:
        store_kv(k, c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"])
    return q


def fused(c: dict) -> torch.Tensor:
    from deepinfer.kernels.rotary_store import rotary_store_kv

    return rotary_store_kv(**c)


def same_bits(c: dict) -> bool:
    """Whether the fused and unfused paths give the same q and caches, bit for bit (each on its own copy
    of the caches)."""
    a = {**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()}
    b = {**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()}
    qa, qb = fused(a), unfused(b)
    fp8 = c["k_cache"].dtype == torch.float8_e4m3fn
    view = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # torch.equal has no e4m3 kernel
    return (torch.equal(qa, qb) and torch.equal(view(a["k_cache"]), view(b["k_cache"]))
            and torch.equal(view(a["v_cache"]), view(b["v_cache"])))


def _step_us(fn, c: dict, layers: int, reps: int = 20) -> float:
    """Median wall time of `layers` back-to-back calls (one decode step's worth), synchronized."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers):
            fn(c)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = ap.parse_args()
    rows = []
    for name, (hq, hkv, d, theta, layers) in SHAPES.items():
        for tokens in args.tokens:
            c = _operands(hq, hkv, d, theta, tokens)
            row = {"shape": name, "tokens": tokens, "bitwise_equal": same_bits(c)}
            for arm, fn in (("fused", fused), ("unfused", unfused)):
                row[f"{arm}_device_us"] = 1e3 * do_bench(lambda fn=fn, c=c: fn(c), warmup=25, rep=100,
                                                         return_mode="median")
                row[f"{arm}_step_us"] = _step_us(fn, c, layers)
            row["layers"] = layers
            row["device_speedup"] = row["unfused_device_us"] / row["fused_device_us"]
            row["step_saved_us"] = row["unfused_step_us"] - row["fused_step_us"]
            rows.append(row)
    cols = ["shape", "tokens", "bitwise_equal", "fused_device_us", "unfused_device_us", "device_speedup",
            "layers", "fused_step_us", "unfused_step_us", "step_saved_us"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                      f, indent=1)
    if not all(r["bitwise_equal"] for r in rows):
        raise SystemExit("fused and unfused results differ: see bitwise_equal")


if __name__ == "__main__":
    main()
