"""Registers, spills and spill instructions inside the key loop of the paged-attention kernel's forms, from
its sm_90 build made on the CPU (no GPU needed): the check a kernel change can get when no device is lent.

    python3 benchmarks/attn_sm90_regs.py [--shapes qwen0.5b,llama8b]

For each head shape (benchmarks/attn_variants.py's SHAPES), cache (bf16, e4m3) and step kind (decode, prefill)
it compiles the engine's tile config (kernels/paged_attention.py, attention_tile_config) twice, as the
one-program form and as the split-KV form (decode: the split programs with their fixed slots, as a CUDA graph
runs them; prefill: the split programs, or the program that merges its rows' ranges itself where the tile has
MERGE_IN_PLACE), with the specialisations a real launch gets (16-byte aligned pointers and strides, PDL on),
through Triton's own sm_90 pipeline; then reads the cubin with the CUDA tools Triton ships (`cuobjdump
-res-usage`, `nvdisasm`). "loop LDL/STL": local-memory instructions between the label and the backward branch
of the kernel's longest loop, the key loop. Figures depend on the Triton version (the H200 host runs 3.6, the
development VM 3.9): record which one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attn_variants import SHAPES  # noqa: E402

_INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh",
         "stride_vb", "stride_vs", "stride_vh")


def _compile(cfg: dict, group: int, head_dim: int, kv_fp8: bool, decode: bool, split: bool):
    import triton
    from deepinfer.kernels.paged_attention_kernel import paged_attention_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kv = "*fp8e4nv" if kv_fp8 else "*bf16"
    scale = "*fp32" if kv_fp8 else "*bf16"
    args = [("q_ptr", "*bf16"), ("k_cache_ptr", kv), ("v_cache_ptr", kv), ("out_ptr", "*bf16"),
            ("plan_ptr", "*i32"), ("qsl_ptr", "*i32"), ("pos_ptr", "*i64"), ("bt_ptr", "*i32"),
            ("k_scale_ptr", scale), ("v_scale_ptr", scale), ("qk_scale", "fp32"),
            *((name, "i32") for name in _INTS), ("stride_bt", "i32")]
    const = dict(GROUP=group, BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                 HEAD_DIM=head_dim, BLOCK_SIZE=16, IEEE=False, KV_FP8=kv_fp8, SWAP=0,
                 FP16_KV=int(bool(cfg["FP16_KV"] and kv_fp8)), V_NAT=0,
                 V_CVT=int(bool(cfg["V_CVT"] and kv_fp8)), PREFETCH=cfg["PREFETCH"], DOT_SUM=cfg["DOT_SUM"],
                 PDL=1)
    if split and (decode or not cfg.get("MERGE_IN_PLACE", 0)):   # split programs: partials to scratch
        args += [("part_ptr", "*fp32"), ("ml_ptr", "*fp32"), ("soff_ptr", "*i64"), ("slot_base", "i32"),
                 ("num_heads", "i32")]
        const.update(MIN_TILES=8, MAX_SPLITS=8, FIXED_SLOTS=decode, ONE_TOKEN=decode, MERGE_IN_PLACE=False)
    elif split:            # a prefill program that merges its rows' ranges itself: no scratch
        const.update(part_ptr=None, ml_ptr=None, soff_ptr=None, slot_base=0, num_heads=0, MIN_TILES=8,
                     MAX_SPLITS=8, FIXED_SLOTS=False, ONE_TOKEN=False, MERGE_IN_PLACE=True)
    else:
        const.update(part_ptr=None, ml_ptr=None, soff_ptr=None, slot_base=0, num_heads=0, MIN_TILES=1,
                     MAX_SPLITS=0, FIXED_SLOTS=False, ONE_TOKEN=False, MERGE_IN_PLACE=False)
    sig = dict(args) | {k: "constexpr" for k in const}
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, typ) in enumerate(args)
               if typ.startswith("*") or name in _INTS}
    src = ASTSource(fn=paged_attention_kernel, signature=sig, constexprs=const, attrs=aligned)
    stages = cfg.get("SPLIT_DECODE_STAGES", cfg["num_stages"]) if split and decode else cfg["num_stages"]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": stages})


def _usage(cubin: bytes) -> dict:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(sass)
             if (m := re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)) and labels.get(m.group(1), i) < i]
    lo, hi = max(loops, key=lambda r: r[1] - r[0]) if loops else (0, 0)
    local = [i for i, line in enumerate(sass) if re.search(r"\b(LDL|STL)\b", line)]
    return {"regs": regs, "stack_bytes": stack, "ldl_stl": len(local),
            "loop_ldl_stl": sum(lo <= i < hi for i in local)}


def main(argv: list[str] | None = None) -> int:
    from deepinfer.kernels.paged_attention import attention_tile_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen0.5b,llama8b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--caches", default="bf16,e4m3")
    ap.add_argument("--steps", default="decode,prefill")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}")
    print("| shape | cache | step | form | registers | stack bytes | LDL/STL | in the key loop |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        for kv_fp8 in [c == "e4m3" for c in args.caches.split(",")]:
            for decode in [s == "decode" for s in args.steps.split(",")]:
                cfg = attention_tile_config(sh.group, sh.d, torch.bfloat16, kv_fp8=kv_fp8, decode=decode)
                for split in (False, True):
                    try:
                        u = _usage(_compile(cfg, sh.group, sh.d, kv_fp8, decode, split).asm["cubin"])
                    except Exception as exc:  # noqa: BLE001 - a Triton without the CUDA backend or its tools
                        raise SystemExit(f"cannot build for sm_90 here: {type(exc).__name__}: {exc}") from exc
                    step = "decode" if decode else "prefill"
                    print(f"| {name} | {'e4m3' if kv_fp8 else 'bf16'} | {step} | "
                          f"{'split' if split else 'one program'} | {u['regs']} | {u['stack_bytes']} | "
                          f"{u['ldl_stl']} | {u['loop_ldl_stl']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
