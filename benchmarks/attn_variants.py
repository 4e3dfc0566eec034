"""Decode-attention kernel variants (issue 16): speed in CUDA graphs, and the bits each one gives a token.

Run on the GPU machine from the repository root (after `pip install -e .`), about 2 minutes:
    python3 benchmarks/attn_variants.py [--out attn_variants.json] [--only NAME,NAME]

Every arm is a pair of tile configs for kernels/paged_attention_kernel.py (through
`launch_paged_attention`): one for decode steps, one for prefill/recompute chunks. They must share BLOCK_N
(the KV tiles fix the online-softmax order). Columns:
- decode_us / kv_gb_s: a decode step of --batch sequences at --context positions (Llama-3.1-8B attention:
  32 q heads, 8 kv heads, head_dim 128, 16-token blocks, scrambled block tables, the CUDA-graph decode plan),
  timed like benchmarks/bench_kv_fp8.py (20 calls in one graph, median of 5 replays);
- prefill_us: the prefill config on 16 fresh 512-token prompts (8192 query tokens);
- dec_eq_pre: decode rows (decode config; ~1300 (sequence, position) pairs of 24 random-length sequences in
  one batch, each position its own one-token step) bitwise equal to the same tokens inside a full prefill
  (prefill config), and to the same tokens inside chunked prefills with random starts. Must be True to ship.
- eq_cur: decode rows bitwise equal to the current kernel's (the baseline arm's) — nice, not required.
- err: worst per-(token, head) relative L2 error vs paged_attention_ref (float32 math on the same cache;
  the e4m3 cache dequantized), over the decode rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attn_arms import ARMS  # noqa: E402
from benchmarks.bench_kv_fp8 import BLOCK_SIZE, DEV, FP8, _decode_meta  # noqa: E402
from benchmarks.common import finish_sweep  # noqa: E402
from benchmarks.fp8_gemm_timing import graph_time  # noqa: E402

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """Attention heads of a model: q heads, kv heads, head_dim."""

    hq: int
    hkv: int
    d: int

    @property
    def group(self) -> int:
        return self.hq // self.hkv


SHAPES = {"llama8b": Shape(32, 8, 128), "qwen0.5b": Shape(14, 2, 64)}


def _shipped(sh: Shape, fp8: bool) -> tuple[dict, dict]:
    """(decode config, prefill config) the engine runs for these heads and cache."""
    from deepinfer.kernels.paged_attention import attention_tile_config

    return tuple(attention_tile_config(sh.group, sh.d, BF16, kv_fp8=fp8, decode=dec) for dec in (True, False))


def _fit(cfg: dict, group: int) -> dict:
    """The config for a GQA group: at least next_pow2(group) rows, BLOCK_Q whole tokens per tile (the way
    kernels/paged_attention.py's attention_tile_config sizes them)."""
    m = max(cfg["BLOCK_M"], 1 << (group - 1).bit_length())
    return dict(cfg, BLOCK_M=m, BLOCK_Q=m // group)


def _scales(hkv: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.rand(hkv, device=DEV, generator=gen) * 0.5 + 0.02,
            torch.rand(hkv, device=DEV, generator=gen) * 0.05 + 0.01)


class _Sched:
    """24 random-length sequences in a NaN-filled paged cache (bf16 or e4m3) and their query rows."""

    def __init__(self, sh: Shape, fp8: bool, seed: int = 5, max_len: int = 800) -> None:
        from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

        gen = torch.Generator().manual_seed(seed)
        self.lens = torch.randint(1, max_len, (24,), generator=gen).tolist()
        self.lens[:3] = [1, 64, 65]
        self.blocks, nb = random_block_lists(self.lens, BLOCK_SIZE, seed=seed)
        g = torch.Generator(device=DEV).manual_seed(seed)
        t = sum(self.lens)
        self.scale = sh.d ** -0.5
        k = torch.randn(t, sh.hkv, sh.d, device=DEV, generator=g) * 2
        v = torch.randn(t, sh.hkv, sh.d, device=DEV, generator=g)
        self.q = torch.randn(t, sh.hq, sh.d, device=DEV, generator=g).to(BF16)
        steps = [SeqStep(self.blocks[b], n, n) for b, n in enumerate(self.lens)]
        full = build_metadata(steps, BLOCK_SIZE, DEV)
        self.offsets = [0]
        for n in self.lens:
            self.offsets.append(self.offsets[-1] + n)
        shape = (nb, BLOCK_SIZE, sh.hkv, sh.d)
        if fp8:
            from deepinfer.kernels.kv_fp8 import store_kv_fp8

            self.ks, self.vs = _scales(sh.hkv, 4)
            self.kc = torch.full(shape, float("nan"), device=DEV).to(FP8)
            self.vc = torch.full(shape, float("nan"), device=DEV).to(FP8)
            store_kv_fp8(k, v, self.kc, self.vc, full.slot_mapping, self.ks, self.vs)
        else:
            from deepinfer.kernels.store_kv import store_kv

            self.ks = self.vs = None
            self.kc = torch.full(shape, float("nan"), device=DEV, dtype=BF16)
            self.vc = torch.full(shape, float("nan"), device=DEV, dtype=BF16)
            store_kv(k.to(BF16), v.to(BF16), self.kc, self.vc, full.slot_mapping)
        self.full = full
        probe = torch.Generator().manual_seed(seed + 1)
        self.decode_rows = [
            (b, p) for b, n in enumerate(self.lens)
            for p in sorted(set(torch.randint(0, n, (60,), generator=probe).tolist()) | {n - 1})]
        self.chunk_starts = [int(torch.randint(0, n, (1,), generator=probe)) for n in self.lens]
        self.ref: torch.Tensor | None = None

    def meta(self, rows: list[tuple[int, int, int]], decode: bool):
        from tests.support.paged_batches import SeqStep, build_metadata

        steps = [SeqStep(self.blocks[b], ctx, ctx - lo) for b, lo, ctx in rows]
        meta = build_metadata(steps, BLOCK_SIZE, DEV)
        if decode:   # the engine's CUDA-graph decode plan: program b -> (b, 0)
            plan = torch.zeros(2 * len(rows), dtype=torch.int32)
            plan[0::2] = torch.arange(len(rows), dtype=torch.int32)
            meta.decode_plan = plan.to(DEV)
        qs = torch.cat([self.q[self.offsets[b] + lo:self.offsets[b] + ctx] for b, lo, ctx in rows])
        return meta, qs

    def run(self, cfg: dict, rows: list[tuple[int, int, int]], decode: bool, split=None) -> torch.Tensor:
        """The rows' outputs under `cfg` and split-KV policy `split` (None: no split); a decode step as a
        CUDA graph runs it (its static plan, split_kv set from the longest row as the runner sets it)."""
        from deepinfer.kernels.paged_attention import launch_paged_attention

        meta, qs = self.meta(rows, decode)
        if decode and split is not None:
            first = split.split_from(cfg["BLOCK_N"])
            meta.split_kv = first is not None and max(ctx for _, _, ctx in rows) - 1 >= first
        return launch_paged_attention(qs, self.kc, self.vc, meta, self.scale, self.ks, self.vs, cfg,
                                      split=split)

    def run_file(self, path: str) -> torch.Tensor:
        """The decode rows through another copy of kernels/paged_attention.py (its `paged_attention`)."""
        import importlib.util

        spec = importlib.util.spec_from_file_location("old_paged_attention", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        meta, qs = self.meta([(b, p, p + 1) for b, p in self.decode_rows], decode=True)
        return mod.paged_attention(qs, self.kc, self.vc, meta, self.scale, self.ks, self.vs)

    def check(self, dec_cfg: dict, pre_cfg: dict, split=None) -> tuple[bool, torch.Tensor, float]:
        """(decode rows == prefill rows bitwise, the decode rows, worst relative error vs the reference),
        under split-KV policy `split` (None: no split)."""
        from deepinfer.kernels.reference.attention import paged_attention_ref

        full = self.run(pre_cfg, [(b, 0, n) for b, n in enumerate(self.lens)], False, split)
        rows = [(b, p, p + 1) for b, p in self.decode_rows]
        dec = self.run(dec_cfg, rows, True, split)
        idx = torch.tensor([self.offsets[b] + p for b, p in self.decode_rows], device=DEV)
        same = torch.equal(dec, full[idx])
        chunks = [(b, lo, n) for b, (lo, n) in enumerate(zip(self.chunk_starts, self.lens, strict=True))]
        chunk_out = self.run(pre_cfg, chunks, False, split)
        cidx = torch.cat([torch.arange(self.offsets[b] + lo, self.offsets[b] + n) for b, lo, n in chunks])
        same = same and torch.equal(chunk_out, full[cidx.to(DEV)])
        if self.ref is None:
            meta, qs = self.meta(rows, decode=True)
            self.ref = paged_attention_ref(qs, self.kc, self.vc, meta, self.scale, self.ks, self.vs).float()
        ref = self.ref
        err = ((dec.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-3)).max().item()
        return same, dec, err


def _decode_operands(sh: Shape, batch: int, context: int, fp8: bool) -> dict:
    meta, num_blocks = _decode_meta(batch, context, seed=context)
    gen = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(batch, sh.hq, sh.d, device=DEV, generator=gen).to(BF16)
    shape = (num_blocks, BLOCK_SIZE, sh.hkv, sh.d)
    k = torch.randn(shape, device=DEV, generator=gen)
    v = torch.randn(shape, device=DEV, generator=gen)
    if fp8:
        ks, vs = _scales(sh.hkv, 1)
        kc = (k / ks.view(1, 1, -1, 1)).clamp(-448, 448).to(FP8)
        vc = (v / vs.view(1, 1, -1, 1)).clamp(-448, 448).to(FP8)
    else:
        ks = vs = None
        kc, vc = k.to(BF16), v.to(BF16)
    return dict(q=q, kc=kc, vc=vc, meta=meta, ks=ks, vs=vs, scale=sh.d ** -0.5)


def _prefill_operands(sh: Shape, fp8: bool, seqs: int = 16, prompt: int = 512) -> dict:
    from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

    blocks, nb = random_block_lists([prompt] * seqs, BLOCK_SIZE, seed=9)
    meta = build_metadata([SeqStep(b, prompt, prompt) for b in blocks], BLOCK_SIZE, DEV)
    gen = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(seqs * prompt, sh.hq, sh.d, device=DEV, generator=gen).to(BF16)
    dtype = FP8 if fp8 else BF16
    kc = torch.randn(nb, BLOCK_SIZE, sh.hkv, sh.d, device=DEV, generator=gen).to(dtype)
    vc = torch.randn(nb, BLOCK_SIZE, sh.hkv, sh.d, device=DEV, generator=gen).to(dtype)
    ks, vs = _scales(sh.hkv, 1) if fp8 else (None, None)
    return dict(q=q, kc=kc, vc=vc, meta=meta, ks=ks, vs=vs, scale=sh.d ** -0.5)


def _time(ops: dict, cfg: dict) -> float:
    from deepinfer.kernels.paged_attention import launch_paged_attention

    def fn(o=ops):
        return launch_paged_attention(o["q"], o["kc"], o["vc"], o["meta"], o["scale"], o["ks"], o["vs"], cfg)

    return graph_time(fn)


def _warm_one(cfgs: list[tuple[dict, bool, tuple[int, int, int]]]) -> str:
    """Compile `cfgs` ((config, e4m3 cache, (hq, hkv, d)) triples) on tiny inputs of the real head shape,
    filling Triton's disk cache for the main process (the specialisation only sees strides, which the token
    count leaves alone)."""
    from deepinfer.kernels.paged_attention import launch_paged_attention

    from tests.support.paged_batches import SeqStep, build_metadata

    meta = build_metadata([SeqStep([1, 2], 20, 20)], BLOCK_SIZE, DEV)
    failed = []
    for cfg, fp8, heads in cfgs:
        sh = Shape(*heads)
        q = torch.randn(20, sh.hq, sh.d, device=DEV).to(BF16)
        dtype = FP8 if fp8 else BF16
        kc = torch.zeros(4, BLOCK_SIZE, sh.hkv, sh.d, device=DEV).to(dtype)
        ks = torch.ones(sh.hkv, device=DEV) if fp8 else None
        try:
            launch_paged_attention(q, kc, kc, meta, 0.1, ks, ks, cfg)
        except Exception as exc:
            failed.append(f"{cfg}: {type(exc).__name__}")
    torch.cuda.synchronize()
    return "; ".join(failed)


def _warm(jobs: list[tuple[dict, bool, Shape]], workers: int = 12) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    unique = list({json.dumps([c, f, repr(sh)], sort_keys=True): (c, f, (sh.hq, sh.hkv, sh.d))
                   for c, f, sh in jobs}.values())
    parts = [unique[i::workers] for i in range(workers)]
    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for res in pool.map(_warm_one, [p for p in parts if p]):
            if res:
                print("warm-up failures:", res, flush=True)
    print(f"compiled {len(unique)} configs in {time.time() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--shapes", default="llama8b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--only", default="",
                    help="comma-separated arm names, each optionally prefixed bf16: or e4m3: (default: all)")
    ap.add_argument("--budget-s", type=float, default=140.0, help="skip the remaining arms past this")
    ap.add_argument("--no-warm", action="store_true", help="compile in this process, not 12 in parallel")
    ap.add_argument("--old-kernel", default=None,
                    help="a paged_attention.py file (e.g. git HEAD's) whose decode rows must equal arm cur's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attn_variants.py needs a CUDA GPU")
    start = time.time()
    only = set(filter(None, args.only.split(",")))
    shapes = [SHAPES[name] for name in args.shapes.split(",")]
    chosen = {c: {n: a for n, a in ARMS["e4m3" if c else "bf16"].items()
                  if not only or n == "cur" or n in only or f"{'e4m3' if c else 'bf16'}:{n}" in only}
              for c in (False, True)}
    if not args.no_warm:
        try:
            _warm([(_fit(cfg, sh.group), fp8, sh) for sh in shapes for fp8, arms in chosen.items()
                   for pair in arms.values() for cfg in (pair or _shipped(sh, fp8))])
        except Exception as exc:  # compiling in this process instead is only slower
            print(f"parallel warm-up failed ({type(exc).__name__}: {exc}); compiling serially", flush=True)
    rows = []
    for sh, (cache, fp8) in [(sh, c) for sh in shapes for c in (("e4m3", True), ("bf16", False))]:
        sched = _Sched(sh, fp8)
        dec_ops = _decode_operands(sh, args.batch, args.context, fp8)
        pre_ops = _prefill_operands(sh, fp8)
        kv_bytes = 2 * args.batch * args.context * sh.hkv * sh.d * dec_ops["kc"].element_size()
        cur_rows = None
        for name, pair in chosen[fp8].items():
            dec_cfg, pre_cfg = (_fit(cfg, sh.group) for cfg in (pair or _shipped(sh, fp8)))
            row = {"shape": f"{sh.hq}/{sh.hkv}/{sh.d}", "cache": cache, "arm": name}
            if time.time() - start > args.budget_s:
                rows.append(dict(row, error="skipped: time budget"))
                continue
            try:
                same, dec, err = sched.check(dec_cfg, pre_cfg)
                if name == "cur":
                    cur_rows = dec
                    if args.old_kernel:
                        row["old_kernel_equal"] = torch.equal(sched.run_file(args.old_kernel), dec)
                sec = _time(dec_ops, dec_cfg)
                pre = _time(pre_ops, pre_cfg)
                row.update(decode_us=sec * 1e6, kv_gb_s=kv_bytes / sec / 1e9, prefill_us=pre * 1e6,
                           dec_eq_pre=same, eq_cur=cur_rows is not None and torch.equal(dec, cur_rows),
                           err=err)
            except Exception as exc:  # a config that does not compile is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = ["shape", "cache", "arm", "decode_us", "kv_gb_s", "prefill_us", "dec_eq_pre", "eq_cur", "err",
            "old_kernel_equal", "error"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                for c in cols) + " |")
    return finish_sweep(rows, args.out, start)


if __name__ == "__main__":
    raise SystemExit(main())
