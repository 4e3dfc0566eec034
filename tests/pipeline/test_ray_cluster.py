"""Scale-out on a Ray cluster, simulated on one machine: a head and two worker nodes
(`ray.cluster_utils.Cluster`, each node with its own CPU resources and raylet) and input and output on
a real S3 endpoint (moto's server). The driver runs in this process, attached to the cluster by its
address; the head node (as on real clusters) offers no CPUs, so engines and tasks run on the workers.

* a job spreads its engines over both worker nodes, both generate parts, each part is committed on the
  worker node that generated it (the summary's `commits`), and the output equals a single-node run's
  byte for byte;
* a local output path on the multi-node cluster is refused with exit 2 before anything is written;
* two drivers on two different worker nodes race on one output: their leases are live at the same
  time, each part is committed once, and the output is byte-identical;
* a worker node removed while a part is in flight on it (its committer's lease names the part; raylet
  and workers killed): the run goes on or exits 75, the parts that were in flight there are recomputed
  and committed once on the node left (the summaries' `commits` say where), and the output is
  byte-identical to a single-node run.

One cluster, one S3 server and one reference output serve the whole module (the node-loss test runs
last, since it takes a node away; its job generates 32 tokens a row, so that a part stays in flight
long enough for the kill to land in it, and has a reference of its own). Tiny data (48 rows, 12
parts), the tiny random Llama, max_tokens 2;
on the shared 2-core development machine at a load average of 15-22 the module took 3.5-5 minutes, most
of it worker processes starting (importing torch) on starved cores.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.output.storage import read_bytes

from tests.support.cli_harness import REPO, reader, snapshot
from tests.support.moto_s3 import moto_s3
from tests.support.ray_local import stop_shared_ray

ray = pytest.importorskip("ray")
pytest.importorskip("moto.server")

FILES, ROWS_PER_FILE, ROWS_PER_PART = 3, 16, 4
PARTS = FILES * ROWS_PER_FILE // ROWS_PER_PART
WORDS = "good bad fine great awful okay nice poor cheap solid broken lovely".split()


@pytest.fixture(scope="module")
def s3():
    """The S3 server, its settings in this process's environment, which the cluster's raylets (started
    below) and so every Ray worker inherit; so do the repository on PYTHONPATH (the racing drivers' actor
    class lives in this module) and one torch thread per worker."""
    with pytest.MonkeyPatch.context() as mp, moto_s3() as server:
        for key, value in server.env.items():
            mp.setenv(key, value)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        mp.setenv("OMP_NUM_THREADS", "1")
        yield server


@pytest.fixture(scope="module")
def cluster(s3, request):
    """(cluster, [worker node handles]): a head with no CPUs for workers and two worker nodes with 3 CPUs
    each (room for both engines and a prepare task on the node left after one is lost)."""
    from ray.cluster_utils import Cluster

    stop_shared_ray(request.config)  # this process attaches to the cluster instead
    if ray.is_initialized():
        pytest.skip("needs a Ray cluster of its own")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [c.add_node(num_cpus=3) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def job(s3, tiny_checkpoint, tmp_path_factory) -> tuple[Path, list[str]]:
    """(spec path, input ids): FILES JSONL files on S3, PARTS parts, the Ray executor."""
    import s3fs

    fs = s3fs.S3FileSystem()
    prefix = s3.url("cluster-input").removeprefix("s3://")
    ids = []
    for f in range(FILES):
        rows = []
        for i in range(ROWS_PER_FILE):
            n = f * ROWS_PER_FILE + i
            review = " ".join(WORDS[(n * 5 + k) % len(WORDS)] for k in range(2 + n % 7))
            rows.append({"rid": f"r{n:04d}", "review": review})
            ids.append(rows[-1]["rid"])
        fs.pipe(f"{prefix}/in/part-{f:02d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = tmp_path_factory.mktemp("cluster") / "job.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "name": "cluster",
        "model": {"path": str(tiny_checkpoint("llama"))},
        "input": {"path": f"s3://{prefix}/in/*.jsonl", "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ review }}"},
        "sampling": {"temperature": 0.8, "max_tokens": 2, "seed": 11},
        "output": {"path": s3.url("unused"), "format": "parquet", "keep_columns": ["review"]},
        "runtime": {"executor": "ray", "rows_per_part": ROWS_PER_PART, "batch_size": 4, "engine_cpus": 1},
    }))
    return spec, ids


@pytest.fixture(scope="module")
def reference(job, s3) -> dict[str, bytes]:
    """A single-node run's output (the local executor, in this process): the bytes every run must give."""
    url = s3.url("reference")
    code = main(["submit", str(job[0]), "--set", f"output.path={url}", "--set", "runtime.executor=local"])
    assert code == 0
    return snapshot(url)


def check_output(job, url: str, reference: dict[str, bytes]) -> None:
    """Every id exactly once, complete, byte-identical to `reference` (the spec recorded in _job.json
    names the executor, which is outside the fingerprint: compare the fingerprints there)."""
    out = reader(url)
    ids = out.read_committed().column("rid").to_pylist()
    assert len(ids) == len(set(ids)) == len(job[1]) and sorted(ids) == job[1]
    assert out.is_complete() and len(out.committed_part_ids()) == PARTS
    got, want = snapshot(url), dict(reference)
    assert json.loads(got.pop("_job.json"))["fingerprint"] == json.loads(want.pop("_job.json"))["fingerprint"]
    assert sorted(got) == sorted(want)  # no orphan, temp file or lease left; nothing missing
    assert got == want  # byte for byte


def out_part_ids(url: str) -> list[str]:
    return sorted(reader(url).committed_part_ids())


def submit_on_cluster(job, url: str, c, *extra: str) -> int:
    return main(["submit", str(job[0]), "--address", c.address, "--set", f"output.path={url}", *extra])


def test_engines_spread_over_the_nodes_and_output_equals_a_single_node_run(job, cluster, reference, s3,
                                                                          tmp_path) -> None:
    c, workers = cluster
    url, summary = s3.url("spread"), tmp_path / "summary.json"
    assert submit_on_cluster(job, url, c, "--summary-json", str(summary)) == 0
    check_output(job, url, reference)
    done = json.loads(summary.read_text())
    # runtime.engines is null: one CPU engine per worker node, placed SPREAD, each naming its node; the
    # first part is dispatched only once both are up (ray_data.run_ray), so both nodes generate parts.
    engines = done["engines"]
    assert {e["engine"].rsplit("@", 1)[1] for e in engines} == {w.node_id[:12] for w in workers}, engines
    assert all(e["rows"] > 0 for e in engines) and sum(e["rows"] for e in engines) == len(job[1]), engines
    # Each part was committed on the worker node that generated it, none by the driver (on the head).
    commits = done["commits"]
    assert {(c["where"], c["node"]) for c in commits["by_node"]} == {("worker", w.node_id) for w in workers}
    assert all(c["parts"] > 0 for c in commits["by_node"]), commits
    assert sorted(c["part"] for c in commits["parts"]) == sorted(out_part_ids(url)), commits
    by_engine = {c["committer"] for c in commits["parts"]}
    assert by_engine == {e["engine"] for e in engines}, (by_engine, engines)


def test_a_local_output_path_on_a_multi_node_cluster_is_refused(job, cluster, tmp_path, capsys) -> None:
    c, _ = cluster
    out = tmp_path / "local-out"
    assert submit_on_cluster(job, str(out), c) == 2
    err = capsys.readouterr().err
    assert "output.path" in err and "runtime.shared_filesystem: true" in err and "2 nodes" in err, err
    assert not out.exists()  # refused before anything was written


@ray.remote(num_cpus=0)
class Driver:
    """A `deepinfer-job submit` process on a chosen node (its own driver of the job, local executor)."""

    def ready(self) -> bool:
        import deepinfer.engine  # noqa: F401 - the slow imports (torch), before the race starts

        return True

    def submit(self, spec: str, url: str, summary: str) -> int:
        return main(["submit", spec, "--set", f"output.path={url}", "--set", "runtime.executor=local",
                     "--summary-json", summary])


def test_two_drivers_on_different_nodes_racing_commit_each_part_once(job, cluster, reference, s3,
                                                                     tmp_path) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c, workers = cluster
    url = s3.url("race")
    drivers = [Driver.options(scheduling_strategy=NodeAffinitySchedulingStrategy(w.node_id, soft=False))
               .remote() for w in workers]
    summaries = [str(tmp_path / f"s{i}.json") for i in range(2)]
    # Both processes up first: on a loaded machine one actor's start can outlast the other's whole run.
    assert ray.get([d.ready.remote() for d in drivers], timeout=300) == [True, True]
    runs = [d.submit.remote(str(job[0]), url, s) for d, s in zip(drivers, summaries)]
    # Watch the leases while both run: two live drivers, on two nodes, at one moment.
    out, together = reader(url), set()
    while len(ray.wait(runs, num_returns=2, timeout=0)[0]) < 2:
        found = [read_bytes(out.fs, p) for p in out.fs.find(out.path("_runs")) if p.endswith(".json")]
        leases = [json.loads(data) for data in found if data is not None]  # None: released meanwhile
        if len(leases) == 2:
            together = {rec["node"] for rec in leases}
        time.sleep(0.05)
    assert ray.get(runs, timeout=300) == [0, 0]
    for d in drivers:
        ray.kill(d)
    assert together == {w.node_id for w in workers}, together
    done = [json.loads(Path(s).read_text()) for s in summaries]
    assert sum(s["parts"]["committed_this_run"] for s in done) == PARTS
    for s in done:
        assert s["parts"]["committed_this_run"] + s["committed_by_others"]["parts"] + s["parts"]["resumed"] \
            == PARTS, s["parts"]
    check_output(job, url, reference)


@pytest.fixture(scope="module")
def slow_reference(job, s3) -> dict[str, bytes]:
    """The single-node output of the node-loss job: the cluster job with SLOW_PART longer generations,
    so that a part stays in flight on its node long enough for the kill to land inside it."""
    url = s3.url("slow-reference")
    code = main(["submit", str(job[0]), "--set", f"output.path={url}", "--set", "runtime.executor=local",
                 *SLOW_PART])
    assert code == 0
    return snapshot(url)


SLOW_PART = ("--set", "sampling.max_tokens=32")


def committer_leases(out) -> list[dict]:
    """The live lease records of the engine actors committing for a run (``_runs/``, role committer)."""
    out.fs.invalidate_cache()
    found = [read_bytes(out.fs, p) for p in out.fs.find(out.path("_runs")) if p.endswith(".json")]
    records = [json.loads(data) for data in found if data is not None]
    return [r for r in records if r.get("role") == "committer"]


def test_parts_in_flight_on_a_lost_node_are_recomputed_and_committed_once(job, cluster, slow_reference,
                                                                         s3, tmp_path) -> None:
    c, workers = cluster
    url = s3.url("node-loss")
    out, in_flight, at_kill, killed = reader(url), [], set(), []
    dead, alive = workers[1].node_id, workers[0].node_id

    def kill_the_node_mid_part() -> None:  # the moment its committer's lease names a part not yet committed
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for rec in committer_leases(out):
                pending = [p for p in rec["parts"] if not out.fs.exists(out.marker_path(p))]
                if rec["node"] == dead and pending:
                    # The committing engine actor first (the cluster's nodes share this machine): a worker
                    # process can outlive its SIGKILLed raylet long enough to finish the part's commit.
                    try:
                        os.kill(int(rec["pid"]), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    c.remove_node(workers[1], allow_graceful=False)  # SIGKILL: raylet, store, workers
                    killed.append(time.monotonic())
                    # Looked at again once the node is dead: a part it committed between the look above
                    # and the kill was not in flight.
                    in_flight.extend(p for p in pending if not out.fs.exists(out.marker_path(p)))
                    at_kill.update(out.committed_part_ids())
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_node_mid_part, daemon=True)
    killer.start()
    summaries = [tmp_path / "first.json", tmp_path / "rerun.json"]
    first = submit_on_cluster(job, url, c, *SLOW_PART, "--summary-json", str(summaries[0]))
    killer.join(timeout=250)
    assert killed and len(at_kill) < PARTS, at_kill  # the node died mid-job
    assert first in (0, 75), first  # went on with the node left (Ray Data retried), or a retryable exit
    assert first == 75 or len(out.committed_part_ids()) == PARTS
    after_first = set(out.committed_part_ids())
    assert submit_on_cluster(job, url, c, *SLOW_PART, "--summary-json", str(summaries[1])) == 0
    check_output(job, url, slow_reference)
    # The runs' own records (the summary's `commits`: each part a run committed, where). The parts in
    # flight on the dead node were recomputed and committed once, on the node left: by the first run's
    # retries (exit 0: the rerun finds the job complete), else by the rerun.
    done = json.loads(summaries[0 if first == 0 else 1].read_text())
    logged = done["commits"]["parts"]
    assert len({e["part"] for e in logged}) == len(logged), logged  # no part committed twice
    assert done["parts"]["committed_this_run"] + done["parts"]["resumed"] == PARTS, done["parts"]
    candidates = in_flight if first == 0 else [p for p in in_flight if p not in after_first]
    recomputed = []
    for part in candidates:
        (entry,) = [e for e in logged if e["part"] == part]
        if entry["node"] == dead:  # the killed node's worker process outlived its raylet long enough to
            continue               # finish this part's commit: it was not lost, so not recomputed
        assert (entry["where"], entry["node"]) == ("worker", alive), entry
        recomputed.append(part)
    # The GCS marks a SIGKILLed node dead only after its health checks fail (seconds, load-dependent).
    deadline = time.monotonic() + 90
    while len([n for n in ray.nodes() if n["Alive"]]) != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the head and the worker left
    if not recomputed:  # the kill landed after the node had committed its part(s): nothing to recompute
        pytest.skip(f"no part was in flight on the killed node (first run exit {first}); every row was "
                    "still committed once and the output is byte-identical")
