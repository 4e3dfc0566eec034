"""GPU: decode steps and prefill chunks of the paged-attention kernel give a token the same bits, bf16 and
e4m3 caches, and both agree with paged_attention_ref; a CUDA-graph prefill step's static plan gives the host
plan's bits.

`paged_attention` runs decode steps (one query token per sequence) with their own tile config
(`attention_tile_config(..., decode=True)`): this checks that a token decoded in a batch of one-token steps
(with the engine's CUDA-graph decode plan and without) is bitwise the token computed as any row of a full
prefill, as the last row of a chunk with a random start, and as a decode row inside a mixed step (a step
with a prefill chunk runs the prefill config for all its rows), for sequences of random lengths.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.split_plan import SplitPolicy

from tests.support.paged_batches import SeqStep, build_metadata, host_step_of, random_block_lists

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BS = 16
# (q heads, kv heads, head_dim): the two benchmark shapes, plus a group of 16 (16-row decode tile, 32-row
# prefill tile), a group of 32 (decode takes the prefill tile) and plain multi-head attention.
SHAPES = {"llama8b": (32, 8, 128), "qwen0.5b": (14, 2, 64), "group16": (32, 2, 128), "group32": (64, 2, 64),
          "mha": (8, 8, 128)}


@pytest.fixture(scope="module", params=[(s, c) for s in SHAPES for c in ("bf16", "e4m3")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels.kv_fp8 import store_kv_fp8
    from deepinfer.kernels.store_kv import store_kv

    shape, cache = request.param
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(21)
    lens = [1, 2, 63, 64, 65, 127, 128, 129] + torch.randint(1, 1200, (24,), generator=gen).tolist()
    blocks, nb = random_block_lists(lens, BS, seed=4)
    g = torch.Generator(device=DEV).manual_seed(22)
    t = sum(lens)
    k = torch.randn(t, hkv, d, device=DEV, generator=g) * 2
    v = torch.randn(t, hkv, d, device=DEV, generator=g)
    q = torch.randn(t, hq, d, device=DEV, generator=g).to(torch.bfloat16)
    fill = build_metadata([SeqStep(blocks[b], n, n) for b, n in enumerate(lens)], BS, DEV)
    if cache == "e4m3":
        ks = torch.rand(hkv, device=DEV, generator=g) * 0.01 + 0.02      # |k| <= ~9: no clamping at 448
        vs = torch.rand(hkv, device=DEV, generator=g) * 0.005 + 0.01
        kc = torch.full((nb, BS, hkv, d), float("nan"), device=DEV).to(torch.float8_e4m3fn)
        vc = kc.clone()
        store_kv_fp8(k, v, kc, vc, fill.slot_mapping, ks, vs)
    else:
        ks = vs = None
        kc = torch.full((nb, BS, hkv, d), float("nan"), device=DEV, dtype=torch.bfloat16)
        vc = kc.clone()
        store_kv(k.to(torch.bfloat16), v.to(torch.bfloat16), kc, vc, fill.slot_mapping)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return dict(lens=lens, blocks=blocks, q=q, kc=kc, vc=vc, ks=ks, vs=vs, offsets=offsets, scale=d ** -0.5)


def _step(s, rows, decode_plan=False, split=None):
    """rows: (seq, first new position, context length after the step); returns (out, meta, q rows).
    decode_plan: as a CUDA-graph decode step (the static plan; split_kv as the runner would set it, from the
    longest row). split: the split-KV policy (None: the shape's default)."""
    from deepinfer.kernels.paged_attention import (
        attention_split_policy,
        attention_tile_config,
        paged_attention,
    )

    meta = build_metadata([SeqStep(s["blocks"][b], ctx, ctx - lo) for b, lo, ctx in rows], BS, DEV)
    qs = torch.cat([s["q"][s["offsets"][b] + lo:s["offsets"][b] + ctx] for b, lo, ctx in rows])
    if decode_plan:
        plan = torch.zeros(2 * len(rows), dtype=torch.int32)
        plan[0::2] = torch.arange(len(rows), dtype=torch.int32)
        meta.decode_plan = plan.to(DEV)
        cfg = attention_tile_config(qs.shape[1] // s["kc"].shape[2], qs.shape[2], qs.dtype,
                                    kv_fp8=s["ks"] is not None, decode=True)
        pol = split or attention_split_policy(cfg)
        first = pol.split_from(cfg["BLOCK_N"])
        meta.split_kv = first is not None and max(ctx for _, _, ctx in rows) - 1 >= first
    out = paged_attention(qs, s["kc"], s["vc"], meta, s["scale"], s["ks"], s["vs"], split=split)
    return out, meta, qs


# Splits from 2 key tiles on (32-256 positions by shape), up to 5: most of the random rows split.
SMALL_SPLITS = SplitPolicy(min_tiles=2, max_splits=5)


def _index(s, rows):
    offsets = s["offsets"]
    return torch.cat([torch.arange(offsets[b] + lo, offsets[b] + ctx) for b, lo, ctx in rows]).to(DEV)


@pytest.mark.parametrize("split", [None, SMALL_SPLITS], ids=["default_splits", "small_splits"])
def test_decode_rows_bitwise_equal_prefill_rows(setup, split):
    """Also across split-KV layouts: the default one (rows past SPLIT_FROM = 1024 split) and one that
    splits most rows; the decode steps include the CUDA-graph form's static split launches."""
    s = setup
    lens = s["lens"]
    run = functools.partial(_step, split=split)
    full, *_ = run(s, [(b, 0, n) for b, n in enumerate(lens)])
    gen = torch.Generator().manual_seed(23)
    probe = [(b, p) for b, n in enumerate(lens)
             for p in sorted(set(torch.randint(0, n, (40,), generator=gen).tolist()) | {0, n - 1})]
    rows = [(b, p, p + 1) for b, p in probe]
    for plan in (True, False):
        dec, *_ = run(s, rows, decode_plan=plan)
        assert torch.equal(dec, full[_index(s, rows)]), f"decode (graph plan {plan}) != prefill rows"
    # the last token of chunks with random starts (a preemption recompute or a chunked prefill)
    chunks = [(b, int(torch.randint(0, n, (1,), generator=gen)), n) for b, n in enumerate(lens)]
    out, *_ = run(s, chunks)
    assert torch.equal(out, full[_index(s, chunks)]), "chunked prefill rows != full prefill rows"
    last = torch.tensor([s["offsets"][b] + n - 1 for b, n in enumerate(lens)], device=DEV)
    dec, *_ = run(s, [(b, n - 1, n) for b, n in enumerate(lens)], decode_plan=True)
    assert torch.equal(dec, full[last]), "decode of each sequence's last token != its prefill row"
    # a mixed step: decode rows next to a prefill chunk (the step runs the prefill config)
    mixed = [(b, n - 1, n) for b, n in enumerate(lens[:-1])] + [(len(lens) - 1, 0, lens[-1])]
    out, *_ = run(s, mixed)
    assert torch.equal(out, full[_index(s, mixed)]), "decode rows in a mixed step != prefill rows"


@pytest.mark.parametrize("split", [None, SMALL_SPLITS], ids=["default_splits", "small_splits"])
def test_decode_and_prefill_match_reference(setup, split):
    s = setup
    lens = s["lens"]
    for rows, plan in (([(b, n - 1, n) for b, n in enumerate(lens)], True),
                       ([(b, n // 3, n) for b, n in enumerate(lens)], False)):
        out, meta, qs = _step(s, rows, decode_plan=plan, split=split)
        assert not out.isnan().any(), "unwritten (NaN) cache slots leaked into the output"
        ref = paged_attention_ref(qs, s["kc"], s["vc"], meta, s["scale"], s["ks"], s["vs"]).float()
        # bf16 p before the PV product (fp16 on the e4m3 cache's fp16 path) and a bf16 output: a few ulps
        # per element; the per-row bound catches logic errors (an off-by-one mask moves a row by percents).
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        row_err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-3)
        assert row_err.max().item() < 2e-2, f"worst (token, head) relative error {row_err.max().item():.2e}"


@pytest.mark.parametrize("split", [None, SMALL_SPLITS], ids=["default_splits", "small_splits"])
def test_static_prefill_plan_gives_the_host_plans_bits(setup, split):
    """A step padded as a CUDA-graph prefill step (engine/runner/prefill_inputs.py: empty sequences, the
    padding sequence, the plan in a static buffer filled to capacity) gives its real rows the bits of the
    same step on the host plan. Where the prefill tile merges a row's ranges in place, rows past the split
    threshold too, in a graph captured for them (split_kv); on the other tiles the runner sends such steps
    down the eager path (runner/prefill_graphs.py), so only rows that do not split are checked there."""
    from deepinfer.engine.runner.prefill_inputs import (
        StaticPrefillBuffers,
        pad_prefill,
        prefill_graph_metadata,
    )
    from deepinfer.kernels.paged_attention import (
        attention_split_policy,
        attention_tile_config,
        paged_attention,
    )

    s = setup
    lens = s["lens"]
    hq, hkv, d = s["q"].shape[1], s["kc"].shape[2], s["q"].shape[2]
    cfg = attention_tile_config(hq // hkv, d, torch.bfloat16, kv_fp8=s["ks"] is not None)
    first = (split or attention_split_policy(cfg)).split_from(cfg["BLOCK_N"])
    merge = bool(cfg["MERGE_IN_PLACE"]) and first is not None
    # a mixed step: decode rows and chunks after a prefix
    rows = [(b, n - 1, n) if b % 3 == 0 else (b, n // 3, n) for b, n in enumerate(lens)
            if merge or first is None or n <= first]
    eager, meta, qs = _step(s, rows, split=split)
    split_kv = merge and max(ctx for _, _, ctx in rows) - 1 >= first
    assert split_kv or not merge
    t = qs.shape[0]
    step = host_step_of(meta)
    for bucket, max_seqs in ((t, len(lens)), (t + 1000, 64)):
        width = meta.block_tables.shape[1]
        buf = StaticPrefillBuffers(bucket, max_seqs, width, cfg["BLOCK_Q"], torch.device(DEV))
        buf.load(pad_prefill(step, bucket, max_seqs, cfg["BLOCK_Q"]))
        qp = torch.randn(bucket, hq, d, device=DEV).to(qs.dtype)
        qp[:t] = qs
        graph_meta = prefill_graph_metadata(buf, bucket, BS, split_kv=split_kv)
        out = paged_attention(qp, s["kc"], s["vc"], graph_meta, s["scale"], s["ks"], s["vs"], split=split)
        assert torch.equal(out[:t], eager), f"static plan (bucket {bucket}, {max_seqs} seqs) != host plan"
