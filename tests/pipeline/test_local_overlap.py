"""The in-process executor overlaps preparation with the engine (executors/local.py, prefetch.py).

Checked while the job runs, not only at its end: each part is committed before the next one's generation
starts; the first part is prepared while the engine builds its model (not during its imports); the
look-ahead never passes one part (the prefetcher's counters and events, no timing); an input file that
breaks after planning, or an engine that refuses its configuration, ends the run with the exit code the
sequential path gave, and no preparing thread is left behind. The output bytes equal the strictly
sequential path's (ahead=0).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.executors.local import run_local
from deepinfer.pipeline.executors.prefetch import PartPrefetcher
from deepinfer.pipeline.parts import PartTask
from deepinfer.pipeline.runner import SubmitOptions, part_tasks, plan_job, run_job
from deepinfer.pipeline.spec.load import load_spec
from deepinfer.pipeline.stages.generate import EngineStage
from deepinfer.pipeline.stages.plan import StagePlan
from deepinfer.pipeline.stages.read import list_input

from tests.support.pipeline_helpers import output_digest, write_jsonl, write_spec

HANG_GUARD_S = 60  # only a bound on a wait for an event that must come; never what a test measures


def _doc(model_dir: str, inp: Path, out: Path, fmt: str = "jsonl", **runtime) -> dict:
    return {"model": {"path": model_dir}, "input": {"path": str(inp), "format": fmt},
            "prompt": {"mode": "raw", "template": "{{ text }}"},
            "sampling": {"temperature": 0.7, "max_tokens": 3, "ignore_eos": True, "seed": 3},
            "output": {"path": str(out), "format": "jsonl"},
            "runtime": {"executor": "local", "rows_per_part": 2, "batch_size": 2, **runtime}}


def _prepare_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "deepinfer-prepare-parts"]


def _committed(out: Path) -> set[str]:
    commits = out / "_commits"
    return {p.stem for p in commits.glob("*.json")} if commits.is_dir() else set()


def test_each_part_commits_before_the_next_generates_and_bytes_match_sequential(
        tmp_path, model_dir, monkeypatch) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"text": f"item {i} is here"} for i in range(9)])  # 5 parts
    reference = tmp_path / "sequential"
    seq = load_spec(write_spec(tmp_path / "seq.yaml", _doc(model_dir, inp, reference)))
    sequential = SubmitOptions(progress=False, execute=lambda spec, plan, parts, opts:
                               run_local(plan, parts, ahead=0))
    assert run_job(seq, sequential) == 0

    out = tmp_path / "overlapped"
    seen: list[tuple[str, set[str]]] = []  # (part generated, parts committed when its generation began)
    generate = EngineStage.generate_part

    def watched(self, table: pa.Table, batch_size: int, finish=None) -> pa.Table:
        seen.append((table.column("__part")[0].as_py(), _committed(out)))
        return generate(self, table, batch_size, finish)

    monkeypatch.setattr(EngineStage, "generate_part", watched)
    assert main(["submit", write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, out))]) == 0
    parts = [p for p, _ in seen]
    assert len(parts) == 5 and parts == sorted(parts)  # in input order, each once
    for k, (_, committed) in enumerate(seen):
        assert committed == set(parts[:k]), (k, committed)  # every earlier part, and no later one
    assert output_digest(out) == output_digest(reference)
    assert not _prepare_threads()


def _plan_and_parts(tmp_path: Path, doc: dict) -> tuple[StagePlan, list]:
    spec = load_spec(write_spec(tmp_path / "plan.yaml", doc))
    listing = list_input(spec.input.path, spec.input.format, {}, stride=spec.runtime.rows_per_part)
    return StagePlan.from_spec(spec), part_tasks(listing, plan_job(listing, spec.runtime.rows_per_part))


def test_first_part_is_prepared_while_the_model_builds_and_look_ahead_stays_one(
        tmp_path, model_dir, monkeypatch) -> None:
    from deepinfer.pipeline.stages import generate

    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"text": f"row {i}"} for i in range(10)])  # 5 parts
    plan, parts = _plan_and_parts(tmp_path, _doc(model_dir, inp, tmp_path / "out"))
    seen: dict[str, int] = {}
    watched: list[PartPrefetcher] = []
    build_llm = generate._build_llm

    def watch(prefetcher: PartPrefetcher) -> None:
        watched.append(prefetcher)
        # Before the engine's imports: the preparing thread is held, nothing prepared.
        assert prefetcher.held.wait(HANG_GUARD_S)
        seen["started_before_imports"] = prefetcher.counters.started

    def build(model_ref, engine_kwargs):
        # The model build starts only once part 0 is prepared and the prefetcher waits for a slot: a
        # preparation that waited for the build would never get there (the guard then fails the test).
        assert watched[0].waiting_for_slot.wait(HANG_GUARD_S)
        seen["prepared_before_build"] = watched[0].counters.prepared
        return build_llm(model_ref, engine_kwargs)

    monkeypatch.setattr(generate, "_build_llm", build)
    results = run_local(plan, parts, watch=watch)
    first = next(results)
    assert seen == {"started_before_imports": 0, "prepared_before_build": 1}
    assert first.column("__part")[0].as_py() == parts[0].part_id
    prefetcher = watched[0]
    # The consumer holds part 0's result: part 1 gets prepared, part 2 must not start.
    assert prefetcher.waiting_for_slot.wait(HANG_GUARD_S)
    c = prefetcher.counters
    assert (c.started, c.prepared, c.taken) == (2, 2, 1)
    rest = list(results)
    assert [t.column("__part")[0].as_py() for t in [first, *rest]] == [p.part_id for p in parts]
    assert (c.started, c.taken, c.max_lead) == (5, 5, 1)
    assert not _prepare_threads()


def test_closing_early_cancels_and_joins_the_preparing_thread(tmp_path, model_dir) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"text": f"row {i}"} for i in range(10)])
    plan, parts = _plan_and_parts(tmp_path, _doc(model_dir, inp, tmp_path / "out",
                                                 benchmark_stub_engine=True))
    watched: list[PartPrefetcher] = []
    results = run_local(plan, parts, watch=watched.append)
    next(results)
    results.close()  # what the driver does when the error budget stops a run early
    assert watched[0].counters.started <= 2 and not _prepare_threads()


def test_a_file_broken_after_planning_exits_2_after_the_parts_before_it(tmp_path, model_dir, monkeypatch,
                                                                       capsys) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    for name in "abc":  # one part per file
        pq.write_table(pa.table({"text": [f"{name} {i}" for i in range(2)]}), inp / f"{name}.parquet")
    out = tmp_path / "out"
    generate = EngineStage.generate_part

    def break_c_during_part_a(self, table: pa.Table, batch_size: int, finish=None) -> pa.Table:
        if not _committed(out):  # part a: the look-ahead has prepared b at most, never c yet
            (inp / "c.parquet").write_bytes(b"no longer parquet" * 8)
        return generate(self, table, batch_size, finish)

    monkeypatch.setattr(EngineStage, "generate_part", break_c_during_part_a)
    doc = _doc(model_dir, inp, out, fmt="parquet")
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc)]) == 2
    err = capsys.readouterr().err
    assert "c.parquet cannot be read as parquet" in err
    assert len(_committed(out)) == 2 and (out / "_FAILED").exists()
    assert not _prepare_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_engine_that_refuses_its_configuration_exits_2(tmp_path, model_dir, capsys) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"text": f"row {i}"} for i in range(6)])
    spec = write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, tmp_path / "out"))
    assert main(["submit", spec, "--set", "model.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "model: the engine refused its configuration" in err and "CUDA is not available" in err
    assert not _committed(tmp_path / "out") and not _prepare_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_restart_whose_engine_refuses_its_configuration_keeps_the_old_output(tmp_path, model_dir,
                                                                              capsys) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_jsonl(inp, [{"text": f"row {i}"} for i in range(6)])
    spec = write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, out))
    assert main(["submit", spec]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["submit", spec, "--restart", "--set", "model.device=cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # refused before --restart deleted anything: still the complete old job
    assert main(["submit", spec, "--restart", "--set", "sampling.seed=4"]) == 0  # a restart that can run
    assert json.loads((out / "_job.json").read_text())["spec"]["sampling"]["seed"] == 4


def test_prefetcher_refuses_no_look_ahead() -> None:
    with pytest.raises(ValueError, match="ahead=0"):
        PartPrefetcher(lambda task: pa.table({}), [], ahead=0)


def test_a_held_prefetcher_prepares_nothing_until_released() -> None:
    tasks = [PartTask(part_id=f"p{i}", file_index=0, url="u", relpath="r", first_row=i, num_rows=1)
             for i in range(3)]
    with PartPrefetcher(lambda task: pa.table({"part": [task.part_id]}), tasks, hold=True) as prefetcher:
        assert prefetcher.held.wait(HANG_GUARD_S) and prefetcher.counters.started == 0
        prefetcher.release()
        assert [prefetcher.next_part().column("part")[0].as_py() for _ in tasks] == ["p0", "p1", "p2"]
    assert not _prepare_threads()
