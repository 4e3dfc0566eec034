"""The local executor's engine preload (executors/engine_preload.py) and the start-up marks it and the
engine add to the run summary; the first-token mark on both engine loops (stages/generate.py).

Ordering and events only, no timing: the preload's thread runs its steps in order (Triton only once the
driver imported the engine, and not at all for a run that ended before), records a mark per step, never
raises (what needed the step fails again on the driver's thread); its libraries open without importing
torch; a local job's summary carries its marks while a stub job (no engine) or the env switch starts
none; the first token is marked inside the engine call, by the overlapped loop too (which never calls
EngineCore.step).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.executors.engine_preload import (
    PRELOAD_ENV,
    EnginePreload,
    cuda_ordinal,
    dlopen_without_gil,
    preload_enabled,
)
from deepinfer.pipeline.runner import part_tasks, plan_job
from deepinfer.pipeline.spec.load import load_spec
from deepinfer.pipeline.stages.plan import StagePlan, prepare_part
from deepinfer.pipeline.stages.read import list_input

from tests.support.pipeline_helpers import write_jsonl, write_spec
from tests.support.startup_checks import check_startup

HANG_GUARD_S = 60  # only a bound on a wait for an event that must come; never what a test measures


def test_cuda_ordinal_of_each_model_device() -> None:
    assert [cuda_ordinal(d) for d in ("auto", "cuda", "cuda:1", "cpu")] == [0, 0, 1, None]


def test_the_preload_env_switch() -> None:
    assert not preload_enabled({}), "off unless asked for (not yet shown to pay on a GPU)"
    assert all(preload_enabled({PRELOAD_ENV: v}) for v in ("1", "true", "On", "yes"))
    assert not any(preload_enabled({PRELOAD_ENV: v}) for v in ("0", "false", "Off", "no"))


def _steps(log: list[str], fail: str | None = None, cuda: bool = True) -> dict:
    def step(name: str):
        def run(*_args):
            log.append(name)
            if name == fail:
                raise OSError(f"{name} failed")
            return cuda if name == "cuda" else None
        return run

    return {"native": step("native"), "start_cuda": step("cuda"), "triton": step("triton")}


def test_preload_steps_run_in_order_on_their_threads() -> None:
    log: list[str] = []
    release = threading.Event()
    steps = _steps(log)
    native = steps["native"]

    def held_native() -> None:
        assert release.wait(HANG_GUARD_S)  # the constructor returned before any step ran
        assert threading.current_thread().name == "deepinfer-engine-preload"
        native()

    reached = threading.Event()
    start_cuda = steps["start_cuda"]

    def cuda(ordinal: int) -> bool:
        reached.set()
        return start_cuda(ordinal)

    preload = EnginePreload(0, **{**steps, "native": held_native, "start_cuda": cuda})
    assert set(preload.marks) == {"started"}
    preload.engine_imported()  # before the first thread's steps: Triton still comes after them
    release.set()
    assert reached.wait(HANG_GUARD_S)
    preload.engine_imported()  # the second call starts nothing more
    assert preload.join(HANG_GUARD_S) and preload.error is None
    assert log == ["native", "cuda", "triton"]
    m = preload.marks
    assert m["started"] <= m["native"] <= m["cuda"] <= m["triton"]


def test_without_cuda_the_preload_ends_after_the_libraries() -> None:
    log: list[str] = []
    preload = EnginePreload(None, **_steps(log))  # model.device: cpu
    assert preload.join(HANG_GUARD_S)
    assert log == ["native"] and set(preload.marks) == {"started", "native"}
    log.clear()
    preload = EnginePreload(0, **_steps(log, cuda=False))  # 'auto' on a machine without a CUDA driver
    assert preload.join(HANG_GUARD_S)
    assert log == ["native", "cuda"] and "cuda" not in preload.marks


def test_triton_waits_for_the_engine_import_and_needs_cuda() -> None:
    log: list[str] = []
    preload = EnginePreload(0, **_steps(log))  # a run that ends before its engine is built
    assert preload.join(HANG_GUARD_S)
    assert log == ["native", "cuda"] and "triton" not in preload.marks
    preload.engine_imported()
    assert preload.join(HANG_GUARD_S) and log == ["native", "cuda", "triton"]
    log.clear()
    preload = EnginePreload(0, **_steps(log, cuda=False))
    preload.engine_imported()
    assert preload.join(HANG_GUARD_S) and log == ["native", "cuda"]  # no context: no Triton


def test_a_failing_step_is_recorded_not_raised_and_ends_the_preload() -> None:
    log: list[str] = []
    preload = EnginePreload(0, **_steps(log, fail="native"))
    assert preload.join(HANG_GUARD_S)
    assert isinstance(preload.error, OSError) and log == ["native"]
    assert set(preload.marks) == {"started"}  # what needed the library raises it again itself


def test_libraries_open_without_importing_their_packages() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from deepinfer.pipeline.executors.engine_preload import dlopen_without_gil, torch_libraries\n"
            "libs = torch_libraries()\n"
            "print(len(libs), dlopen_without_gil(libs), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "2", "False"]  # both opened, and torch is still not imported
    assert dlopen_without_gil([Path("/nonexistent/libnothing.so")]) == 0  # skipped, never raised


def _doc(model_dir: str, inp, out, **runtime) -> dict:
    return {"model": {"path": model_dir, "device": "cpu"},
            "input": {"path": str(inp), "format": "jsonl", "id_column": "rid"},
            "prompt": {"mode": "raw", "template": "{{ text }}"},
            "sampling": {"temperature": 0, "max_tokens": 3, "ignore_eos": True},
            "output": {"path": str(out), "format": "jsonl"},
            "runtime": {"executor": "local", "rows_per_part": 2, "batch_size": 2, **runtime}}


def test_local_job_reports_preload_and_engine_build_marks(tmp_path, model_dir, capsys, monkeypatch) -> None:
    monkeypatch.setenv(PRELOAD_ENV, "1")
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": f"r{i}", "text": f"item {i}"} for i in range(4)])
    out = tmp_path / "out"
    assert main(["submit", write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, out))]) == 0
    s = check_startup(json.loads((out / "_SUCCESS").read_text())["summary"], ray=False)
    # started by the CLI before the run's clock, before the input is planned
    assert s["engine_preload_started_s"] <= 0 and s["engine_preload_started_s"] <= s["model_checked_s"]
    assert s["engine_preload_started_s"] <= s["engine_preload_native_s"]
    assert s["engine_preload_cuda_s"] is None and s["engine_preload_triton_s"] is None  # model.device: cpu
    build = [s[k] for k in ("engine_imported_s", "engine_allocated_s", "engine_weights_loaded_s",
                            "engine_kv_allocated_s", "model_loaded_s")]
    assert all(m is not None for m in build) and build == sorted(build), s
    assert "  preload   from " in capsys.readouterr().out  # the printed summary's line


def test_a_stub_job_starts_no_preload(tmp_path, model_dir, monkeypatch) -> None:
    monkeypatch.setenv(PRELOAD_ENV, "1")   # even when asked for
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": f"r{i}", "text": f"item {i}"} for i in range(2)])
    out = tmp_path / "out"
    doc = _doc(model_dir, inp, out, benchmark_stub_engine=True)
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc)]) == 0
    s = json.loads((out / "_SUCCESS").read_text())["summary"]["startup"]
    assert {k: v for k, v in s.items() if k.startswith("engine_preload_")} == dict.fromkeys(
        ("engine_preload_started_s", "engine_preload_native_s", "engine_preload_cuda_s",
         "engine_preload_triton_s"))


@pytest.mark.parametrize("value", [None, "0"], ids=["unset", "0"])
def test_without_the_env_switch_there_is_no_preload(tmp_path, model_dir, monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv(PRELOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(PRELOAD_ENV, value)
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": "r0", "text": "item"}])
    out = tmp_path / "out"
    assert main(["submit", write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, out))]) == 0
    s = check_startup(json.loads((out / "_SUCCESS").read_text())["summary"], ray=False)
    assert s["engine_preload_started_s"] is None


@pytest.mark.parametrize("sync_loop", [False, True], ids=["overlapped", "synchronous"])
def test_first_token_is_marked_inside_the_engine_call(tmp_path, model_dir, monkeypatch, sync_loop) -> None:
    if sync_loop:
        monkeypatch.setenv("DEEPINFER_SYNC_LOOP", "1")
    else:
        monkeypatch.delenv("DEEPINFER_SYNC_LOOP", raising=False)
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": f"r{i}", "text": f"item {i} is here"} for i in range(2)])
    spec = load_spec(write_spec(tmp_path / "job.yaml", _doc(model_dir, inp, tmp_path / "out")))
    listing = list_input(spec.input.path, "jsonl", {}, stride=2)
    plan = StagePlan.from_spec(spec)
    task = part_tasks(listing, plan_job(listing, 2))[0]
    stage = plan.engine_stage()
    assert stage.llm.engine.async_scheduling is not sync_loop
    generate = stage.llm.generate
    inside: list[float | None] = []

    def watched(*args, **kwargs):
        out = generate(*args, **kwargs)
        inside.append(stage.first_token_at)  # before EngineStage's end-of-call fallback could set it
        return out

    stage.llm.generate = watched
    stage.generate_part(prepare_part(plan, task), plan.batch_size)
    assert inside and inside[0] is not None
    scheduler = stage.llm.engine.scheduler
    assert scheduler.update.__func__ is type(scheduler).update  # unwrapped after the first token


_GPU_PRELOAD = """
from deepinfer.pipeline.executors.engine_preload import EnginePreload
preload = EnginePreload(0)
import deepinfer.engine.llm, torch
preload.engine_imported()
assert preload.join(120), "preload still running"
assert preload.error is None, repr(preload.error)
assert {"native", "cuda", "triton"} <= set(preload.marks), preload.marks
x = torch.arange(4, device="cuda:0", dtype=torch.float32)
assert float((x * 2).sum()) == 12.0 and torch.cuda.current_device() == 0
print("ok", {k: round(v - preload.marks["started"], 3) for k, v in preload.marks.items()})
"""


@pytest.mark.gpu
def test_the_real_preload_opens_torch_starts_cuda_and_imports_triton() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GPU_PRELOAD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
