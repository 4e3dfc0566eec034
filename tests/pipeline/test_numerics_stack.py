"""A deterministic job's parts all come from one numerics stack (pipeline/output/numerics.py).

Byte-identical output holds on one hardware and software stack: a job killed on one machine and resumed
on another would otherwise mix two kinds of bits in one output. The stack of every commit is recorded
(`_numerics.json`, each marker's "numerics"), a deterministic job refuses parts of another stack (exit 4)
before writing them, and its engines refuse before generating; a fast-mode job records and goes on.
The store-level cases drive OutputStore directly; the end-to-end ones run `deepinfer-job submit` with a
tiny model, its engine made to report another machine's stack by the test entry point
(tests/support/killable_cli.py).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch
from deepinfer.engine.runner.numerics_stack import numerics_stack
from deepinfer.pipeline.errors import NumericsMismatch
from deepinfer.pipeline.output.commit import OutputStore, make_job_record
from deepinfer.pipeline.output.layout import NUMERICS_FILE
from deepinfer.pipeline.output.status import job_status, render_status

from tests.support import commit_harness as H
from tests.support.cli_harness import cli, reader, snapshot, submit, write_jsonl

HERE = "cpu x86_64 AVX2 GenuineIntel, torch 2.13.0+cpu"
THERE = "cuda sm_90, torch 2.11.0+cu130, cuda 13.0, triton 3.6.0"
OTHER = "cuda sm_80, torch 2.11.0+cu130, cuda 13.0, triton 3.6.0"


def test_the_stack_names_the_device_architecture_and_software() -> None:
    stack = numerics_stack(torch.device("cpu"))
    assert stack.startswith("cpu ") and f"torch {torch.__version__}" in stack
    assert torch.backends.cpu.get_cpu_capability() in stack
    assert stack == numerics_stack(torch.device("cpu"))  # a pure function of the machine


@pytest.mark.gpu
def test_a_cuda_stack_names_the_architecture_and_the_compilers() -> None:
    stack = numerics_stack(torch.device("cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert stack.startswith(f"cuda sm_{major}{minor}, torch {torch.__version__}, cuda {torch.version.cuda}, "
                            "triton "), stack
    assert not stack.endswith("triton none"), stack  # the GPU engine's kernels are Triton's


def _store(tmp_path: Path, deterministic: bool = True) -> tuple[OutputStore, list]:
    parts, record = H.job()
    record = make_job_record({"model": {"deterministic": deterministic}}, record["fingerprint"], parts,
                             "parquet")
    store = OutputStore(str(tmp_path / "out"))
    store.begin(record)
    return store, parts


def _commit(store: OutputStore, part, stacks: list[str]) -> bool:
    rows, errors = H.part_tables(part, 0)
    return store.commit_part(part.part_id, rows, errors, "parquet", numerics=stacks)


# (deterministic, first part's stacks, second part's stacks, second refused)
CASES = [
    (True, [HERE], [HERE], False),
    (True, [HERE], [THERE], True),
    (True, [HERE], [HERE, THERE], True),   # one part from two machines
    (True, [], [THERE], False),            # nothing generated first (every row quarantined): no claim
    (False, [HERE], [THERE], False),       # fast mode promises no identical bytes: recorded, not refused
    (False, [HERE], [HERE, THERE], False),
]


@pytest.mark.parametrize("deterministic,first,second,refused", CASES)
def test_a_deterministic_job_commits_parts_of_one_stack_only(tmp_path, deterministic, first, second,
                                                              refused) -> None:
    store, parts = _store(tmp_path, deterministic)
    with store:
        assert _commit(store, parts[0], first)
        if refused:
            with pytest.raises(NumericsMismatch, match=re.escape(f"[{first[0]}]")) as info:
                _commit(store, parts[1], second)
            assert NumericsMismatch(str(info.value)).exit_code == 4
            assert store.committed_part_ids() == {parts[0].part_id}
            assert not list((tmp_path / "out" / "parts").glob(f"{parts[1].part_id}-*"))  # nothing written
        else:
            assert _commit(store, parts[1], second)
        markers = store.read_markers()
    assert markers[parts[0].part_id].get("numerics", []) == first
    recorded = json.loads((tmp_path / "out" / NUMERICS_FILE).read_text())["numerics"]
    assert recorded == (first or second)[0]
    if not refused:
        assert markers[parts[1].part_id]["numerics"] == second


def test_a_claim_that_never_committed_is_removed_by_the_next_run(tmp_path) -> None:
    store, parts = _store(tmp_path)
    with store:  # a run that claimed its stack, then died before its first marker
        store.numerics.claim(parts[0].part_id, [THERE])
    assert (tmp_path / "out" / NUMERICS_FILE).exists()
    store, parts = _store(tmp_path)  # the next run's begin cleans it up: it records nothing
    with store:
        assert not (tmp_path / "out" / NUMERICS_FILE).exists()
        assert _commit(store, parts[0], [HERE])
    assert json.loads((tmp_path / "out" / NUMERICS_FILE).read_text())["numerics"] == HERE


def test_restart_and_a_refused_first_run_take_the_record_away(tmp_path) -> None:
    store, parts = _store(tmp_path)
    with store:
        assert _commit(store, parts[0], [HERE])
    parts, record = H.job(seed=1)  # another job: --restart deletes the old output, the stack included
    with OutputStore(str(tmp_path / "out")) as store:
        assert store.begin(record, restart=True).restarted
        assert not (tmp_path / "out" / NUMERICS_FILE).exists()
        store.numerics.claim(parts[0].part_id, [THERE])
        assert store.discard_if_unstarted()  # refused before any part: no record of it stays
    left = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.parent.name != "_runs"]
    assert not left


# ---- end to end: deepinfer-job submit, killed, then resumed "on another machine" --------------------

SPEC = """\
name: numerics
model:
  path: {model}
  deterministic: {deterministic}
input:
  path: {data}
  format: jsonl
  id_column: rid
prompt:
  mode: raw
  template: "Review: {{{{ review }}}}"
sampling:
  temperature: 0.8
  max_tokens: 2
  seed: 7
output:
  path: {root}/unused
  format: parquet
runtime:
  executor: local
  rows_per_part: 8
  batch_size: 8
"""


def _job(tmp_path: Path, model: Path, deterministic: bool) -> Path:
    data = write_jsonl(tmp_path / "reviews.jsonl",
                       [{"rid": f"r{i:03d}", "review": "good " * (1 + i % 5)} for i in range(32)])
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC.format(model=model, data=data, root=tmp_path,
                                deterministic=str(deterministic).lower()))
    return spec


def _committed(url: str) -> dict[str, bytes]:
    """The output's objects, without the leases of runs (a killed run's is removed by the next)."""
    return {k: v for k, v in snapshot(url).items() if not k.startswith("_runs/") and k != "_FAILED"}


def _killed_after_one_part(spec: Path, url: str) -> dict[str, bytes]:
    code, _, err = submit(spec, url, kill_at="after_part_committed:1")
    assert code == -signal.SIGKILL, err[-3000:]
    assert len(reader(url).committed_part_ids()) == 1
    return _committed(url)


def test_a_deterministic_resume_on_another_stack_exits_4_before_generating(tmp_path,
                                                                           tiny_checkpoint) -> None:
    spec = _job(tmp_path, tiny_checkpoint("llama"), deterministic=True)
    reference, url = str(tmp_path / "reference"), str(tmp_path / "out")
    code, out, err = submit(spec, reference, "--summary-json", str(tmp_path / "summary.json"))
    assert code == 0, err[-3000:]
    here = json.loads((Path(reference) / NUMERICS_FILE).read_text())["numerics"]
    assert here == numerics_stack(torch.device("cpu"))
    summary = json.loads((tmp_path / "summary.json").read_text())  # the run summary names it too
    assert [e["numerics"] for e in summary["engines"]] == [here] and f"numerics  {here}" in out
    before = _killed_after_one_part(spec, url)

    code, _, err = submit(spec, url, numerics=OTHER)
    assert code == 4, err[-3000:]
    assert f"[{here}]" in err and f"[{OTHER}]" in err and "--restart" in err
    assert re.search(r"engine \S+: the job's committed parts", err), err[-3000:]  # refused before a part
    assert _committed(url) == before  # the committed part untouched
    assert job_status(url)["failure"]["reason"] == "other_job"

    code, _, err = submit(spec, url)  # back on the machine that started it: resumes
    assert code == 0, err[-3000:]
    assert snapshot(url) == snapshot(reference)
    assert job_status(url)["numerics"] == [here]


def test_verify_says_when_the_rows_were_computed_on_another_stack(tmp_path, tiny_checkpoint) -> None:
    spec = _job(tmp_path, tiny_checkpoint("llama"), deterministic=True)
    url = str(tmp_path / "out")
    assert submit(spec, url)[0] == 0
    code, out, err = cli("verify", url, "--sample", "4")
    assert code == 0 and "note:" not in out, out + err
    for marker in (Path(url) / "_commits").glob("*.json"):  # as if the job had run on a GPU
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "numerics": [THERE]}))
    code, out, err = cli("verify", url, "--sample", "4")
    assert code == 0, out + err  # the rows were in fact computed here: they match
    assert f"note: the sampled rows were computed with [{THERE}]" in out, out


def test_a_fast_mode_resume_on_another_stack_goes_on_and_says_so(tmp_path, tiny_checkpoint) -> None:
    spec = _job(tmp_path, tiny_checkpoint("llama"), deterministic=False)
    url = str(tmp_path / "out")
    _killed_after_one_part(spec, url)
    here = json.loads((Path(url) / NUMERICS_FILE).read_text())["numerics"]
    code, _, err = submit(spec, url, numerics=OTHER)
    assert code == 0, err[-3000:]
    markers = reader(url).read_markers()
    assert sorted(tuple(m["numerics"]) for m in markers.values()) == sorted([(OTHER,)] * 3 + [(here,)])
    status = job_status(url)
    assert status["numerics"] == sorted([here, OTHER])
    assert here in render_status(status) and OTHER in render_status(status)


def test_ray_engines_refuse_an_output_started_on_another_stack(tmp_path, tiny_checkpoint, shared_ray) -> None:
    spec = _job(tmp_path, tiny_checkpoint("llama"), deterministic=True)
    url = str(tmp_path / "out")
    _killed_after_one_part(spec, url)
    record = Path(url) / NUMERICS_FILE  # as if the run that committed the part had run on a GPU node
    record.write_text(json.dumps({"numerics": THERE}))
    before = _committed(url)
    ray = {"RAY_ADDRESS": shared_ray.start()}
    code, _, err = submit(spec, url, "--set", "runtime.executor=ray", env=ray)
    assert code == 4, err[-3000:]
    refused = r"engine \S+@\w+: the job's committed parts were computed with " + re.escape(f"[{THERE}]")
    assert re.search(refused, err), err[-3000:]  # an engine actor refused, before generating
    assert _committed(url) == before
    here = numerics_stack(torch.device("cpu"))
    record.write_text(json.dumps({"numerics": here}))  # back where it started: the actors resume it
    summary = tmp_path / "summary.json"
    code, _, err = submit(spec, url, "--set", "runtime.executor=ray", "--summary-json", str(summary), env=ray)
    assert code == 0, err[-3000:]
    assert {e["numerics"] for e in json.loads(summary.read_text())["engines"]} == {here}
    assert {tuple(m["numerics"]) for m in reader(url).read_markers().values()} == {(here,)}
