"""`runtime.executor: auto` (the default, executors/choice.py): local for one engine and no named Ray
cluster, else Ray; the run summary says which executor ran and why."""

from __future__ import annotations

import json
import sys

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.executors.choice import (
    choose_executor,
    local_engine_count,
    sweep_with_executor,
    visible_gpus,
)
from deepinfer.pipeline.executors.ray_data import RaySession, engine_count
from deepinfer.pipeline.spec.load import load_spec
from deepinfer.pipeline.summary import validate_summary

from tests.support.pipeline_helpers import write_jsonl, write_spec


def _spec(tmp_path, runtime: dict | None = None, model: dict | None = None, sweep: dict | None = None):
    doc = {"model": {"name": "demo", **(model or {})},
           "input": {"path": str(tmp_path / "in.jsonl"), "format": "jsonl"},
           "prompt": {"mode": "raw", "template": "{{ text }}"},
           "output": {"path": str(tmp_path / "out"), "format": "jsonl"}, "runtime": runtime or {}}
    if sweep is not None:
        doc["sweep"] = sweep
    return load_spec(write_spec(tmp_path / "job.yaml", doc))


@pytest.fixture
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        pytest.skip("this test process is connected to Ray: 'auto' would rightly pick it")


@pytest.mark.parametrize("runtime, model, gpus, name, reason", [
    ({}, {}, 0, "local", "auto: one engine (CPU), no Ray address"),
    ({}, {}, 1, "local", "auto: one engine (1 GPU), no Ray address"),
    ({}, {"device": "cpu"}, 4, "local", "auto: one engine (CPU), no Ray address"),
    ({}, {}, 2, "ray", "auto: 2 engines (2 GPUs) on this machine"),
    ({}, {"tensor_parallel_size": 2}, 2, "local", "auto: one engine (2 GPUs), no Ray address"),
    ({}, {"tensor_parallel_size": 2}, 8, "ray", "auto: 4 engines (8 GPUs) on this machine"),
    ({"engines": 1}, {}, 8, "local", "auto: one engine (8 GPUs), no Ray address"),
    ({"engines": 2}, {}, 0, "ray", "auto: 2 engines (CPU) on this machine"),
    ({"executor": "ray"}, {}, 0, "ray", "runtime.executor: ray"),
    ({"executor": "local"}, {}, 8, "local", "runtime.executor: local"),
])
def test_auto_runs_one_engine_locally_and_several_on_ray(tmp_path, no_cluster, runtime, model, gpus, name,
                                                         reason) -> None:
    spec = _spec(tmp_path, runtime, model)
    choice = choose_executor(spec, None, gpus=gpus)
    assert (choice.name, choice.reason) == (name, reason)


def test_the_engine_count_is_the_one_a_local_ray_run_uses(tmp_path) -> None:
    for gpus in (0, 1, 3, 8):
        for tp in (1, 2):
            spec = _spec(tmp_path, {}, {"tensor_parallel_size": tp})
            session = RaySession(owned=True, num_gpus=gpus, num_cpus=16.0, node_cpus=(16.0,))
            assert local_engine_count(spec, gpus, 16.0) == engine_count(None, session, gpus > 0, tp)


def test_a_named_cluster_keeps_ray(tmp_path, no_cluster, monkeypatch) -> None:
    spec = _spec(tmp_path)
    choice = choose_executor(spec, "ray://head:10001", gpus=1)
    assert (choice.name, choice.reason) == ("ray", "auto: a Ray cluster is named (--address ray://head:10001)")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert choose_executor(spec, None, gpus=1).reason == "auto: a Ray cluster is named (RAY_ADDRESS is set)"


def test_visible_gpus_reads_cuda_visible_devices_then_device_nodes(tmp_path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvme0"):
        (tmp_path / name).write_text("")
    assert visible_gpus({}, str(tmp_path)) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}, str(tmp_path)) == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}, str(tmp_path)) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, str(tmp_path)) == 0
    assert visible_gpus({}, str(tmp_path / "missing")) == 0


def test_a_sweep_decides_once_and_its_points_carry_the_executor(tmp_path) -> None:
    from deepinfer.pipeline.sweep import point_specs

    spec = _spec(tmp_path, sweep={"grid": {"sampling.seed": [1, 2]}})
    assert spec.runtime.executor == "auto"
    choice = choose_executor(spec, None, gpus=2)
    resolved = sweep_with_executor(spec, choice)
    assert resolved.runtime.executor == "ray" and spec.document["runtime"]["executor"] == "auto"
    assert [s.runtime.executor for _, s in point_specs(resolved)] == ["ray", "ray"]


def test_the_default_submit_runs_locally_and_the_summary_says_why(tmp_path, model_dir, no_cluster,
                                                                  monkeypatch, capsys) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # one CPU engine on any machine
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"text": f"row {i}"} for i in range(3)])
    doc = {"model": {"path": model_dir}, "input": {"path": str(inp), "format": "jsonl"},
           "prompt": {"mode": "raw", "template": "{{ text }}"},
           "sampling": {"temperature": 0, "max_tokens": 2, "ignore_eos": True},
           "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
           "runtime": {"rows_per_part": 2, "benchmark_stub_engine": True}}
    summary_path = tmp_path / "summary.json"
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc), "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    validate_summary(summary)
    assert summary["executor"] == {"name": "local", "reason": "auto: one engine (CPU), no Ray address"}
    assert summary["startup"]["executor_started_s"] is None  # no Ray was started
    captured = capsys.readouterr()
    assert "executor  local (auto: one engine (CPU), no Ray address)" in captured.out
    assert "on the local executor" in captured.err
