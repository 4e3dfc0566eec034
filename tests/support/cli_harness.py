"""Running `deepinfer-job submit` in its own process group, killing it, and comparing outputs.

Shared by tests/pipeline/test_chaos.py and tests/pipeline/test_poison_rows.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deepinfer.pipeline.output.layout import OutputReader
from deepinfer.pipeline.output.storage import open_fs

REPO = str(Path(__file__).resolve().parents[2])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def start_submit(spec: Path, output: str, *extra: str, env: dict | None = None,
                 kill_at: str | None = None, pause_at: str | None = None,
                 numerics: str | None = None) -> subprocess.Popen:
    """`deepinfer-job submit SPEC --set output.path=OUTPUT ...` in a new session (own process group);
    `kill_at` / `pause_at`: SIGKILL or pause it at commit-protocol points (tests/support/kill_hooks.py);
    `numerics`: the numerics stack its in-process engine reports (as if on another machine)."""
    full_env = {**os.environ, **(env or {})}
    for name in ("DEEPINFER_TEST_KILL_AT", "DEEPINFER_TEST_PAUSE_AT", "DEEPINFER_TEST_NUMERICS"):
        full_env.pop(name, None)
    module = "deepinfer.pipeline.cli"
    if kill_at or pause_at or numerics:  # the product has no such hooks: the test entry point installs them
        full_env["DEEPINFER_TEST_KILL_AT"] = kill_at or ""
        full_env["DEEPINFER_TEST_PAUSE_AT"] = pause_at or ""
        full_env["DEEPINFER_TEST_NUMERICS"] = numerics or ""
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH")]))
        module = "tests.support.killable_cli"
    cmd = [sys.executable, "-m", module, "submit", str(spec), "--set", f"output.path={output}", *extra]
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def submit(spec: Path, output: str, *extra: str, env: dict | None = None,
           kill_at: str | None = None, numerics: str | None = None) -> tuple[int, str, str]:
    proc = start_submit(spec, output, *extra, env=env, kill_at=kill_at, numerics=numerics)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the submit's whole process group, and any descendant that left it, by pid."""
    stragglers = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def kill_after_commits(proc: subprocess.Popen, reader: OutputReader, commits: int, delay_s: float) -> bool:
    """Kill once ``commits`` parts are committed, ``delay_s`` later; False when the run finished first."""
    while proc.poll() is None and len(reader.committed_part_ids()) < commits:
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is not None:
        proc.communicate()
        return False
    kill_group(proc)
    return True


def snapshot(url: str, storage_options: dict | None = None) -> dict[str, bytes]:
    """Every object of an output (run leases included) except _SUCCESS, which holds the run's timings;
    output.path is dropped from _job.json so that outputs written to different places compare."""
    fs, root = open_fs(url, storage_options)
    prefix = root.rstrip("/") + "/"
    objects = {p[len(prefix):]: fs.cat_file(p) for p in fs.find(root)}
    objects.pop("_SUCCESS", None)
    job = json.loads(objects["_job.json"])
    job["spec"]["output"].pop("path")
    objects["_job.json"] = json.dumps(job, sort_keys=True).encode()
    return objects


def reader(url: str, storage_options: dict | None = None) -> OutputReader:
    return OutputReader(*open_fs(url, storage_options))
