"""The M-bucket planner (kernels/bucket_planner.py) on CPU with plain-torch launches: buckets only after the
proof agrees, one verdict per (N, K, dtype, device) taken once, the single config where the proof fails or
the first call is being captured; the rowwise FP8 bucket table's invariants (kernels/fp8_rowwise.py) and
the sweep's report on it (benchmarks/fp8_sweep.py); and the interpreted rowwise TMA / planner tests in the
session's TRITON_INTERPRET=1 process."""

from __future__ import annotations

import inspect

import pytest
import torch
from deepinfer.kernels.bucket_planner import BucketPlanner, bucket_for, outputs_agree

from tests.support.interpreted import launches, run_interpreted

BUCKETS = ((16, "small"), (64, "mid"), (None, "large"))


def _planner(launch, buckets=BUCKETS, calls=None):
    def table(n, k, dtype):
        if calls is not None:
            calls.append(("buckets", n, k))
        return buckets

    return BucketPlanner(table, lambda n, k, dtype: "single", launch)


def _matmul_launch(log):
    # A launch whose bits depend on the config only through `log` (so every config agrees).
    def launch(x, w, cfg):
        log.append(cfg)
        return x @ w.T

    return launch


def test_bucket_for_picks_the_first_bucket_covering_m():
    assert [bucket_for(BUCKETS, m) for m in (1, 16, 17, 64, 65, 10**6)] == \
        ["small", "small", "mid", "mid", "large", "large"]


def test_outputs_agree_compares_bits_not_closeness():
    base = torch.ones(3)
    assert outputs_agree(lambda cfg: base * 1.0, ["a", "b"])
    assert not outputs_agree(lambda cfg: base + (1e-7 if cfg == "b" else 0.0), ["a", "b"])


def test_planner_proves_once_per_shape_then_uses_the_buckets():
    log: list = []
    planner = _planner(_matmul_launch(log))
    x, w = torch.randn(40, 8), torch.randn(12, 8)
    assert planner.choose(40, 12, 8, x.dtype, x.device, x, w) == "mid"
    assert log == ["small", "mid", "large"]                # the proof ran every bucket's config once
    assert [planner.choose(m, 12, 8, x.dtype, x.device, x, w) for m in (1, 16, 17, 64, 65, 9000)] == \
        ["small", "small", "mid", "mid", "large", "large"]
    assert len(log) == 3                                   # ... and never again for this shape
    assert planner.verdicts() == {"12x8 float32 cpu": True}
    planner.choose(5, 24, 8, x.dtype, x.device, x, torch.randn(24, 8))   # another shape: its own proof
    assert len(log) == 6 and len(planner.verdicts()) == 2


def test_planner_keeps_the_single_config_for_every_m_where_configs_disagree():
    def launch(x, cfg):
        return x + (1e-3 if cfg == "large" else 0.0)       # one bucket's bits differ

    planner = _planner(launch)
    x = torch.randn(4, 8)
    for m in (1, 16, 64, 65, 9000):
        assert planner.choose(m, 12, 8, x.dtype, x.device, x) == "single"
    assert planner.verdicts() == {"12x8 float32 cpu": False}


def test_planner_verdicts_are_per_dtype_and_per_planner():
    seen: list = []

    def launch(x, cfg):
        seen.append((x.dtype, cfg))
        return x

    a, b = _planner(launch), _planner(launch)
    x = torch.randn(4, 8)
    a.choose(4, 12, 8, torch.float32, x.device, x)
    a.choose(4, 12, 8, torch.bfloat16, x.device, x.bfloat16())
    b.choose(4, 12, 8, torch.float32, x.device, x)         # another engine's planner proves it again
    assert len(seen) == 9
    assert set(a.verdicts()) == {"12x8 float32 cpu", "12x8 bfloat16 cpu"}


def test_a_single_bucket_needs_no_proof():
    def launch(*args):
        raise AssertionError("no proof for one config")

    planner = _planner(launch, buckets=((None, "only"),))
    assert planner.choose(7, 12, 8, torch.float32, torch.device("cpu")) == "only"
    assert planner.verdicts() == {}


def test_first_call_under_capture_keeps_the_single_config(monkeypatch):
    def launch(*args):
        raise AssertionError("no proof while a CUDA graph is being captured")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    planner = _planner(launch)
    assert planner.choose(7, 12, 8, torch.bfloat16, torch.device("cuda", 0)) == "single"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # The verdict stands after the capture: this engine keeps one config for the shape.
    assert planner.choose(300, 12, 8, torch.bfloat16, torch.device("cuda", 0)) == "single"
    assert planner.verdicts() == {"12x8 bfloat16 cuda:0": False}


@pytest.fixture(scope="module")
def fr():
    pytest.importorskip("triton")
    from deepinfer.kernels import fp8_rowwise

    return fp8_rowwise


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (96, 64)])
def test_rowwise_buckets_share_block_k_and_imprecise_acc_and_cover_every_m(fr, n, k):
    buckets = fr.rowwise_buckets(n, k)
    assert buckets[-1][0] is None
    bounds = [b for b, _ in buckets[:-1]]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    single = fr.rowwise_tile_config(None, n, k)
    for _, cfg in buckets:    # the dot chain of an element is the same in every bucket and the fallback
        assert (cfg["BLOCK_K"], cfg.get("IMPRECISE_ACC", 0)) == (single["BLOCK_K"], single["IMPRECISE_ACC"])
    assert buckets == fr.rowwise_buckets(n, k)
    assert set(inspect.signature(fr.rowwise_buckets).parameters) == {"n", "k"}


def test_rowwise_proof_runs_probe_rows_and_pointer_loads(fr, monkeypatch):
    # The proof multiplies fixed probe rows (not the first call's, which may be a warm-up's zeros) with the
    # call's weight, and runs every bucket config with TMA and with pointer loads.
    probe = (torch.ones(3, 4), torch.ones(3, 1))
    monkeypatch.setattr(fr, "_probe_rows", lambda k, device, dtype: probe)
    runs: list = []
    monkeypatch.setattr(fr, "rowwise_matmul",
                        lambda xq, xs, w, ws, b, dt, cfg: runs.append((xq, w, cfg)) or xq)
    weight = torch.zeros(8, 4)
    buckets = fr.rowwise_buckets(4096, 4096)
    assert fr.RowwisePlanner()._agree(torch.zeros(5, 4), None, weight, None, None, torch.bfloat16, buckets)
    assert all(xq is probe[0] and w is weight for xq, w, _ in runs)
    tma = [cfg for _, cfg in buckets]
    assert all(cfg.get("TMA") for cfg in tma)
    pointer = [{k: v for k, v in cfg.items() if k not in ("TMA", "PERSISTENT", "FLATTEN")} for cfg in tma]
    compared = [cfg for _, _, cfg in runs]
    assert all(c in compared for c in tma + pointer) and len(compared) == len({str(c) for c in tma + pointer})


def test_fast_mode_takes_the_bucket_tiles(fr):
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 64, 65, 256, 257, 8192):
            assert fr.rowwise_tile_config(m, n, k) == bucket_for(fr.rowwise_buckets(n, k), m)


def test_a_config_that_fails_to_run_counts_as_disagreeing(caplog):
    def run(cfg):
        if cfg == "huge":
            raise RuntimeError("out of resources: shared memory")
        return torch.ones(2)

    assert not outputs_agree(run, ["a", "huge"])
    assert "huge" in caplog.text and "keeping one config" in caplog.text


def test_outputs_agree_compares_raw_bits():
    nan = torch.tensor([float("nan"), 1.0])
    assert outputs_agree(lambda cfg: nan.clone(), ["a", "b"])            # the same NaN bits agree
    signed = {"a": torch.tensor([0.0]), "b": torch.tensor([-0.0])}
    assert not outputs_agree(lambda cfg: signed[cfg], ["a", "b"])         # -0.0 is other bits than 0.0


def test_sweep_report_groups_bitwise_classes_and_rates_the_bucket_table(fr):
    # benchmarks/fp8_sweep.py's summary on made-up timings: the classes of identical bits, the fastest
    # member per M within each, and how the current bucket table does (what the lead picks tables from).
    from benchmarks.fp8_sweep import _bucket_table, _name, _summarise, sweep_table

    buckets = fr.rowwise_buckets(4096, 4096)
    names = [_name(cfg) for _, cfg in buckets]
    ms = (64, 256, 2048)
    times = {name: {m: 10.0 + i + m / 64 for m in ms} for i, name in enumerate([*names, "odd"])}
    times["odd"][2048] = 1.0                                   # fastest at 2048, but other bits
    heads = {name: {m: torch.zeros(4) + (name == "odd") for m in ms} for name in times}
    summary = _summarise(times, heads, {}, ms)
    assert sorted(map(sorted, summary["bitwise_classes"])) == sorted([sorted(names), ["odd"]])
    assert summary["best_per_m"][2048]["config"] == "odd"
    table = _bucket_table(buckets, summary, times, ms)
    assert table["agree_bitwise"] and table["configs"] == names
    assert table["per_m"][64]["config"] == _name(bucket_for(buckets, 64))
    cls = next(i for i, c in enumerate(summary["bitwise_classes"]) if names[0] in c)
    assert summary["best_per_m_by_class"][cls][2048]["config"] in names
    text = sweep_table({"rowwise/o": {**summary, "bucket_table": table}, "skipped_for_budget": ["block/o"]})
    assert "agree bitwise: True" in text and "block/o" in text


@pytest.mark.parametrize("promote", [0, 128])
def test_sweep_adds_the_promoted_form_of_each_candidate_by_name(fr, promote):
    # `--sweep-promote N`: every rowwise candidate also with IMPRECISE_ACC = N, told apart by name, so the
    # promoted form of each table tile can be timed beside it (benchmarks/fp8_sweep.py).
    from benchmarks.fp8_sweep import _name, _rowwise_candidates

    plain = _rowwise_candidates(("tma",), False)
    swept = _rowwise_candidates(("tma",), False, promote)
    names = [_name(c) for c in swept]
    assert len(set(names)) == len(names) and swept[:len(plain)] == plain
    extra = swept[len(plain):]
    assert all(c["IMPRECISE_ACC"] == promote and "imprecise_acc" in _name(c) for c in extra)
    promoted = {_name({**c, "IMPRECISE_ACC": promote}) for c in plain
                if promote and not c.get("IMPRECISE_ACC")}
    assert {_name(c) for c in extra} == promoted - {_name(c) for c in plain}
    tile = _name(fr.rowwise_buckets(4096, 14336)[0][1])
    picked = _rowwise_candidates(("tma",), (tile,), promote)
    assert [c.get("IMPRECISE_ACC", 0) for c in picked] == [0]


@launches("tests/kernels/test_fp8_rowwise_tma_interpreted.py")
def test_rowwise_tma_and_planner_pass_under_interpreter(request):
    run_interpreted(request, "rowwise FP8 TMA GEMM and planner")
