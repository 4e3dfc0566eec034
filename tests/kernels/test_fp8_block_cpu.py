"""The block-scaled FP8 path on CPU: the group-quantization references are the unfused compositions, the
bucket table's config names parse, and the interpreted kernels run in the session's TRITON_INTERPRET=1
process (tests/support/interpreted.py: test_fp8_block_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fp8_fused_quant import rms_norm_group_quant_ref, silu_and_mul_group_quant_ref
from deepinfer.kernels.reference.fp8_matmul import quantize_act_ref

from tests.support.interpreted import launches, run_interpreted


def test_group_references_are_the_unfused_compositions():
    from deepinfer.kernels.reference.activation import silu_and_mul_ref
    from deepinfer.kernels.reference.rmsnorm import rms_norm_ref

    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 80, generator=gen), torch.randn(5, 80, generator=gen)
    w = torch.rand(80, generator=gen) + 0.5
    out, summed = rms_norm_ref(x, w, 1e-6, r)
    q, s, res = rms_norm_group_quant_ref(x, w, 1e-6, 32, r)
    want_q, want_s = quantize_act_ref(out, 32)
    assert torch.equal(res, summed) and torch.equal(s, want_s) and s.shape == (5, 3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # Each group's max maps onto +-448 (the partial last group's too).
    assert torch.equal(q.float().abs()[:, :64].view(5, 2, 32).amax(-1), torch.full((5, 2), 448.0))
    qa, sa = silu_and_mul_group_quant_ref(torch.cat([x, r], 1), 16)
    want = quantize_act_ref(silu_and_mul_ref(torch.cat([x, r], 1)), 16)
    assert torch.equal(sa, want[1]) and torch.equal(qa.view(torch.uint8), want[0].view(torch.uint8))


def test_block_config_names_round_trip_and_the_table_parses():
    bp = pytest.importorskip("deepinfer.kernels.fp8_block_plan")
    for name in (*bp.BLOCK_SWEEP_CANDIDATES, "64x128x128 w4 s3 k1 tma pers2"):
        assert bp.config_name(bp.parse_config(name)) == name
    cfg = bp.parse_config("128x256x128 w8 s3 tma pers1")
    got = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["TMA"], cfg["PERSISTENT"])
    assert got == (128, 256, 8, 1, 1)
    assert "TMA" not in bp.parse_config(bp.REFERENCE) and bp.parse_config(bp.REFERENCE)["K_LOOP"] == 0
    for bad in ("64x128 w4 s3", "64x128x128 w4 s3 pers1", "64x128x128 w4 s3 fast"):
        with pytest.raises(ValueError, match="block config"):
            bp.parse_config(bad)
    for cls, buckets in bp.BLOCK_BUCKET_TABLE.items():
        bounds = [b for b, _ in buckets]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), cls
        for _, name in buckets:      # every bucket keeps the reference's K step and K loop (same chain)
            cfg = bp.parse_config(name)
            assert cfg["BLOCK_K"] == 128 and cfg["K_LOOP"] == 0 and "COL_SCALES" not in cfg
    assert [bp.shape_class(n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [
        "default", "default", "wide", "long_k"]
    assert bp.block_tile_config(None, 28672, 4096) == bp.parse_config(bp.REFERENCE)
    assert bp.block_tile_config(1, 28672, 4096) == bp.block_buckets(28672, 4096)[0][1]


@launches("tests/kernels/test_fp8_block_interpreted.py")
def test_block_fp8_kernels_pass_under_interpreter(request):
    run_interpreted(request, "fused group quantization, block TMA tile scales, BlockPlanner")


def test_sweep_table_keeps_only_reference_equal_candidates_and_loads_as_a_table(tmp_path):
    """benchmarks/fp8_block_sweep.bucket_table: per class and M the fastest candidate equal to the reference
    at every M (and invariant), summed over the class's layers, adjacent picks merged, the last open; the
    JSON bench_fp8.py writes loads back through load_block_table (DEEPINFER_FP8_BLOCK_TABLE)."""
    import json
    import sys
    from pathlib import Path

    bp = pytest.importorskip("deepinfer.kernels.fp8_block_plan")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.fp8_block_sweep import bucket_table

    ref, a, b = bp.REFERENCE, "64x64x128 w4 s4 tma", "128x128x128 w8 s3 tma"
    fast_wrong = "64x32x128 w4 s6 tma"      # the fastest everywhere, but not the reference's bits

    def rec(cls, us, wrong=()):
        same = {c: {m: c not in wrong for m in t} for c, t in us.items()}
        return {"class": cls, "us": us, "same_as_ref": same, "invariant": dict.fromkeys(us, True)}

    report = {"ms": [1, 64, 2048], "reference": ref, "layers": {
        "qkv": rec("default", {ref: {1: 9, 64: 9, 2048: 90}, a: {1: 5, 64: 6, 2048: 120},
                               b: {1: 8, 64: 9, 2048: 70}, fast_wrong: {1: 1, 64: 1, 2048: 1}}, [fast_wrong]),
        "o": rec("default", {ref: {1: 9, 64: 9}, a: {1: 5, 64: 6}, b: {1: 9, 64: 9}}),   # M=2048 cut
        "down": rec("long_k", {ref: {1: 20, 64: 20, 2048: 150}, b: {1: 30, 64: 30, 2048: 100}}),
    }}
    table = bucket_table(report)
    assert table == {"default": [(64, a), (None, b)], "long_k": [(64, ref), (None, b)]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    loaded = bp.load_block_table(str(path))
    assert loaded["default"] == ((64, a), (None, b)) and loaded["wide"] == bp.BLOCK_BUCKET_TABLE["wide"]
    assert bp.block_tile_config(2048, 4096, 4096, loaded) == bp.parse_config(b)
    assert bp.load_block_table(None) is bp.BLOCK_BUCKET_TABLE
    for bad in ({"default": [[64, a]]}, {"default": [[None, a], [64, b]]}, {"other": [[None, a]]},
                {"default": [[None, "64x64 w4"]]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            bp.load_block_table(str(path))
