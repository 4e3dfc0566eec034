"""The paged-attention kernel's split-KV form under Triton's interpreter (a TRITON_INTERPRET=1 subprocess
started by tests/kernels/test_paged_attention_variants_cpu.py), tiny shapes, float32 and e4m3 caches.

A row past the policy's threshold reduces its keys in several ranges (kernels/split_plan.py): in a decode step
each range is its own program, merged by kernels/split_combine.py; in a prefill or mixed step either the same
(tiles without MERGE_IN_PLACE: the host plan's split programs and the combine) or one program reduces its
rows' ranges one after another and merges them as it goes. Checked here: agreement with paged_attention_ref
for prefill, chunked, prefix-hit and decode rows in every tile family the engine runs (plain, DOT_SUM,
PREFETCH, FP16_KV on e4m3); rows of one split keep the one-program form's bits exactly; the static decode plan
(a CUDA graph's) gives the host plan's bits, also when the scratch budget cuts it into several launches; a
decode step's split programs and combine give a row the bits of either prefill form under the same tile
config; the default policy splits exactly from SPLIT_FROM on. Decode and prefill rows under their own configs
(different MMA shapes) are compared bit for bit on the GPU: tests/kernels/test_paged_attention_decode_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.kernels.reference.attention import paged_attention_ref
from deepinfer.kernels.split_plan import SplitPolicy, split_counts

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.paged_batches import (
    SeqStep,
    build_metadata,
    filled_step,
    float32_and_e4m3_step,
    padded_decode_metadata,
    same_bits,
)

skip_unless_interpreting("tests/kernels/test_paged_attention_variants_cpu.py")

BS, HQ, HKV, D, BLOCK_N = 16, 8, 2, 16, 32
# Rows at positions >= 64 split (3 tiles of 32 and more): 64..95 in two, 160.. in three.
POLICY = SplitPolicy(min_tiles=2, max_splits=3)
# (context, new tokens): one split; a prefill crossing both thresholds; a chunk starting in split 0 and
# ending in split 1; decodes of three and two splits; a one-token sequence.
LENS = [(37, 5), (170, 170), (90, 40), (300, 1), (70, 1), (1, 1)]


@pytest.fixture(scope="module")
def pa():
    return interpreted_kernels("paged_attention")


@pytest.fixture(scope="module")
def step():
    return float32_and_e4m3_step(LENS, BS, HQ, HKV, D, seed=21, table_seed=4)


def _cfg(block_m: int, dot_sum: int = 0, prefetch: int = 0, fp16_kv: int = 0, vcvt: int = 0, warps: int = 4,
         stages: int = 2, merge: int = 0) -> dict[str, int]:
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // (HQ // HKV), "BLOCK_N": BLOCK_N, "num_warps": warps,
            "num_stages": stages, "SWAP": 0, "FP16_KV": fp16_kv, "V_NAT": 0, "V_CVT": vcvt,
            "PREFETCH": prefetch, "DOT_SUM": dot_sum, "MERGE_IN_PLACE": merge}


CONFIGS = {   # the engine's tile families, in tiny form; merge: prefill programs merge their rows' ranges
    "plain_prefill": _cfg(32, merge=1),
    "plain_decode": _cfg(16, merge=1),
    "plain_split_programs": _cfg(32),
    "dot_sum_one_warp": _cfg(16, dot_sum=1, warps=1, stages=3),
    "dot_sum_prefill": _cfg(64, dot_sum=1, warps=2),
    "prefetch": _cfg(32, prefetch=1, stages=3),
}


def _operands(c: dict, e4m3: bool) -> tuple:
    st = c["st"]
    if e4m3:
        return c["q"], c["k8"], c["v8"], st.meta, 0.3, c["ks"], c["vs"]
    return c["q"], st.k_cache, st.v_cache, st.meta, 0.3, None, None


def test_the_step_has_rows_of_one_two_and_three_splits(step):
    pos = step["st"].meta.positions.numpy()
    assert set(split_counts(pos, BLOCK_N, POLICY.min_tiles, POLICY.max_splits).tolist()) == {1, 2, 3}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("e4m3", [False, True])
def test_split_form_matches_reference(pa, step, name, e4m3):
    cfg = dict(CONFIGS[name])
    if e4m3:
        cfg.update(FP16_KV=1, V_CVT=1)
    q, kc, vc, meta, scale, ks, vs = _operands(step, e4m3)
    out = pa.launch_paged_attention(q, kc, vc, meta, scale, ks, vs, cfg, split=POLICY)
    ref = paged_attention_ref(q, kc, vc, meta, scale, ks, vs)
    assert not out.isnan().any()
    tol = 2e-3 if e4m3 else 2e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["plain_prefill", "plain_split_programs", "dot_sum_prefill", "prefetch"])
def test_rows_of_one_split_keep_the_one_program_bits(pa, step, name):
    q, kc, vc, meta, scale, ks, vs = _operands(step, False)
    split = pa.launch_paged_attention(q, kc, vc, meta, scale, ks, vs, CONFIGS[name], split=POLICY)
    whole = pa.launch_paged_attention(q, kc, vc, meta, scale, ks, vs, CONFIGS[name], split=None)
    one = split_counts(meta.positions.numpy(), BLOCK_N, POLICY.min_tiles, POLICY.max_splits) == 1
    assert one.sum() > 0 and (~one).sum() > 0
    assert same_bits(split[torch.from_numpy(one)], whole[torch.from_numpy(one)])
    assert not torch.equal(split[torch.from_numpy(~one)], whole[torch.from_numpy(~one)])


def _decode_case(positions: list[int], seed: int):
    """A cache holding each row's context (finite block 0: padding rows read it) and q for 16 rows."""
    gen = torch.Generator().manual_seed(seed)
    st = filled_step([(p + 1, 1) for p in positions], BS, HKV, D, gen, table_seed=seed)
    kc, vc = st.k_cache.clone(), st.v_cache.clone()
    for c in (kc, vc):
        c[0] = torch.where(c[0].isnan(), torch.randn(c[0].shape, generator=gen), c[0])
    tables = st.meta.block_tables.tolist()
    blocks = [tables[i][: -(-(p + 1) // BS)] for i, p in enumerate(positions)]
    return blocks, kc, vc, torch.randn(16, HQ, D, generator=gen)


@pytest.mark.parametrize("positions,bucket", [([300, 5, 70, 170, 64, 63], 8), ([170], 1), ([5, 40], 4)])
def test_static_decode_plan_gives_the_host_plans_bits(pa, positions, bucket):
    blocks, kc, vc, q = _decode_case(positions, seed=len(positions))
    eager, graph = padded_decode_metadata(blocks, positions, bucket, BS)
    graph.split_kv = True
    cfg = pa.attention_tile_config(HQ // HKV, D, torch.float32, decode=True)
    qs = q[:bucket].contiguous()
    host = pa.paged_attention(qs, kc, vc, eager, 0.3, split=POLICY)
    static = pa.paged_attention(qs, kc, vc, graph, 0.3, split=POLICY)
    n = len(positions)
    assert cfg["BLOCK_N"] == BLOCK_N and not static[:n].isnan().any()
    assert same_bits(static[:n], host[:n])
    torch.testing.assert_close(static[:n], paged_attention_ref(qs, kc, vc, eager, 0.3)[:n], atol=2e-5,
                               rtol=2e-5)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_scratch_budget_cuts_launches_without_changing_bits(pa, step, monkeypatch, kind):
    """The host plan of split programs (a decode step, or a prefill under tiles without MERGE_IN_PLACE)."""
    from deepinfer.kernels import split_combine

    if kind == "decode":
        positions = [300, 5, 70, 170, 64, 63, 299, 100]
        blocks, kc, vc, q = _decode_case(positions, seed=5)
        meta, _ = padded_decode_metadata(blocks, positions, len(positions), BS)
        args = (q[:len(positions)].contiguous(), kc, vc, meta, 0.3, None, None, CONFIGS["plain_decode"])
    else:
        q, kc, vc, meta, scale, ks, vs = _operands(step, True)
        args = (q, kc, vc, meta, scale, ks, vs, dict(CONFIGS["plain_split_programs"], FP16_KV=1, V_CVT=1))
    whole = pa.launch_paged_attention(*args, split=POLICY)
    # two (token, split) slots per launch: the host plan cuts the step into many launch groups
    monkeypatch.setattr(split_combine, "SCRATCH_BUDGET_BYTES", 2 * HQ * (D + 2) * 4)
    args[3].__dict__.pop("_split_kv_plans", None)
    cut = pa.launch_paged_attention(*args, split=POLICY)
    assert not whole.isnan().any() and same_bits(cut, whole)


@pytest.mark.parametrize("group,head_dim,dtype,kv_fp8,splits", [
    (7, 64, torch.bfloat16, False, True), (1, 64, torch.float16, False, True),
    (4, 16, torch.float32, False, True), (4, 128, torch.bfloat16, True, True),
    (7, 64, torch.bfloat16, True, True), (4, 128, torch.bfloat16, False, False),
])
def test_default_policy_splits_from_split_from_on_but_for_16_bit_128_dim_heads(pa, group, head_dim, dtype,
                                                                               kv_fp8, splits):
    for decode in (False, True):
        cfg = pa.attention_tile_config(group, head_dim, dtype, kv_fp8=kv_fp8, decode=decode)
        pol = pa.attention_split_policy(cfg)
        at = np.array([pa.SPLIT_FROM - 1, pa.SPLIT_FROM, 64 * pa.SPLIT_FROM])
        counts = split_counts(at, cfg["BLOCK_N"], pol.min_tiles, pol.max_splits)
        assert counts.tolist() == ([1, 2, pa.MAX_SPLITS] if splits else [1, 1, 1])
        assert pol.split_from(cfg["BLOCK_N"]) == (pa.SPLIT_FROM if splits else None)
        assert cfg["SPLIT"] == splits
        # the four-warp plain tiles merge a prefill row's ranges in place; the one-/two-warp DOT_SUM tiles
        # cannot hold the second accumulator and keep the split programs (kernels/paged_attention.py)
        assert cfg["MERGE_IN_PLACE"] == (cfg["DOT_SUM"] == 0)


def test_graph_steps_split_as_captured_and_prefill_graphs_never(pa, step):
    from deepinfer.kernels.split_plan import NO_SPLIT

    _, graph = padded_decode_metadata([[1]], [3], 2, BS)
    assert not pa._needs_split(graph, POLICY, BLOCK_N)        # captured for short rows
    graph.split_kv = True
    assert pa._needs_split(graph, POLICY, BLOCK_N)
    assert not pa._needs_split(graph, NO_SPLIT, BLOCK_N)
    meta = step["st"].meta
    assert pa._needs_split(meta, POLICY, BLOCK_N)              # host lengths: the 300-token row splits
    assert not pa._needs_split(meta, SplitPolicy(min_tiles=10, max_splits=3), BLOCK_N)


@pytest.mark.parametrize("name,merge", [("plain_decode", 1), ("plain_decode", 0), ("dot_sum_one_warp", 0),
                                        ("dot_sum_one_warp", 1)])
def test_decode_rows_take_the_bits_of_the_same_rows_in_a_prefill(pa, name, merge):
    """A decode step's programs hold one token, so its split layout is one scalar and its loop the plain
    one; a prefill program keeps a layout per row and either runs one split of its rows (merge 0) or all of
    them, merging as it goes (merge 1). Under one tile config (the interpreter's matmul is only reproducible
    per shape) every decoded row equals its row of a full prefill, across split counts."""
    cfg = dict(CONFIGS[name], MERGE_IN_PLACE=merge)
    gen = torch.Generator().manual_seed(8)
    lens = [300, 170, 64]
    st = filled_step([(n, n) for n in lens], BS, HKV, D, gen, table_seed=6)
    q = torch.randn(st.meta.num_tokens, HQ, D, generator=gen)
    full = pa.launch_paged_attention(q, st.k_cache, st.v_cache, st.meta, 0.3, None, None, cfg, split=POLICY)
    tables = st.meta.block_tables.tolist()
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    probe = [(b, p) for b, n in enumerate(lens) for p in sorted({0, 31, 63, 64, 95, 96, 159, 160, n - 1})
             if p < n]
    meta = build_metadata([SeqStep(tables[b][: p // BS + 1], p + 1, 1) for b, p in probe], BS)
    rows = torch.tensor([starts[b] + p for b, p in probe])
    dec = pa.launch_paged_attention(q[rows].contiguous(), st.k_cache, st.v_cache, meta, 0.3, None, None, cfg,
                                    split=POLICY)
    counts = split_counts(np.array([p for _, p in probe]), BLOCK_N, POLICY.min_tiles, POLICY.max_splits)
    assert set(counts.tolist()) == {1, 2, 3}
    assert same_bits(dec, full[rows])


def test_cuda_ops_run_a_tiny_llama_with_split_rows_like_transformers(pa, tmp_path, monkeypatch):
    """The CUDA backend's dense path (rotary + KV store, paged attention in its split forms, the combine) on
    the interpreter, float32, with the split threshold at 32 positions: a prefill chunk and the rest of the
    prompt (programs that merge their rows' ranges), then a decode step (a program per split, the combine),
    every row past position 32 in 2-4 splits; logits match transformers."""
    from tests.support.paged_runner import check_cuda_ops_against_transformers
    from tests.support.tiny_models import make_tiny_checkpoint

    monkeypatch.setattr("deepinfer.kernels.paged_attention.SPLIT_FROM", 32)
    forms = []
    launch = pa._launch

    def record(*args, **kwargs):
        form = "one_token" if kwargs.get("ONE_TOKEN") else "merge" if kwargs.get("MAX_SPLITS") else "one"
        forms.append(form)
        return launch(*args, **kwargs)

    monkeypatch.setattr(pa, "_launch", record)
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    a, b = [5 + (7 * i) % 200 for i in range(90)], [40 + 3 * i for i in range(20)]
    cfg = check_cuda_ops_against_transformers(path, a, b, first=50)
    layers = cfg.num_hidden_layers   # every step had split rows, in every layer
    assert forms == ["merge"] * 2 * layers + ["one_token"] * layers


@pytest.mark.parametrize("seed,merge", [(0, 1), (1, 1), (2, 0), (3, 0)])
def test_random_policies_and_schedules_give_a_row_one_result(pa, seed, merge):
    """Random split policies, sequence lengths and chunkings under one tile config: every row computed in a
    full prefill, in a chunk with a random start and as a decode step has the same bits, close to the
    reference."""
    import random

    rng = random.Random(seed)
    policy = SplitPolicy(min_tiles=rng.randint(1, 3), max_splits=rng.randint(2, 5))
    lens = [rng.randint(1, 200) for _ in range(3)] + [rng.randint(100, 200)]
    cfg = dict(CONFIGS["plain_decode"], MERGE_IN_PLACE=merge)
    gen = torch.Generator().manual_seed(seed)
    st = filled_step([(n, n) for n in lens], BS, HKV, D, gen, table_seed=seed)
    q = torch.randn(st.meta.num_tokens, HQ, D, generator=gen)
    tables = st.meta.block_tables.tolist()
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def run(rows):   # rows: (seq, first new position, context after the step)
        meta = build_metadata([SeqStep(tables[b][: -(-ctx // BS)], ctx, ctx - lo) for b, lo, ctx in rows], BS)
        idx = torch.cat([torch.arange(starts[b] + lo, starts[b] + ctx) for b, lo, ctx in rows])
        return pa.launch_paged_attention(q[idx].contiguous(), st.k_cache, st.v_cache, meta, 0.3, None, None,
                                         cfg, split=policy), idx

    full, _ = run([(b, 0, n) for b, n in enumerate(lens)])
    torch.testing.assert_close(full, paged_attention_ref(q, st.k_cache, st.v_cache, st.meta, 0.3), atol=2e-5,
                               rtol=2e-5)
    chunks, idx = run([(b, rng.randrange(n), n) for b, n in enumerate(lens)])
    assert same_bits(chunks, full[idx])
    probe = [(b, rng.randrange(n)) for b, n in enumerate(lens) for _ in range(4)] + [(3, lens[3] - 1)]
    dec, idx = run([(b, p, p + 1) for b, p in probe])
    assert same_bits(dec, full[idx])
    assert split_counts(np.array([lens[3] - 1]), BLOCK_N, policy.min_tiles, policy.max_splits)[0] > 1
