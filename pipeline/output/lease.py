"""Run leases: which runs are live on an output, so that orphan cleanup never races a live writer.

Each run that may write to an output holds ``_runs/{run_id}.json``:
``{"run_id", "host", "pidns", "node", "pid", "pid_start", "heartbeat", "cleaning"}``, refreshed by a
heartbeat thread. A lease is dead when its process is gone (same host and pid namespace: checked through
/proc, including pid reuse via the process start time) or its heartbeat is older than ``ttl_s`` (other
hosts, and other containers of this host, whose pids /proc here does not show). Dead leases are removed
by whoever notices. ``node`` is the Ray node id of a driver attached to Ray (or null), for `status`.

Across nodes the heartbeat is the only liveness signal, compared with this machine's clock: clocks must
agree to well within ``ttl_s`` (120 s; NTP keeps them within milliseconds). A driver whose node dies
stops beating; its lease goes stale after ``ttl_s`` and the next run's cleanup proceeds then.

Why this makes cleanup safe (the protocol in :class:`deepinfer.pipeline.output.commit.OutputStore`):
a run A deletes orphans only as ``set own cleaning=True -> snapshot the objects -> list leases -> delete from
the snapshot iff no other live lease -> cleaning=False``, and every run B, before its first write, writes its
lease and then waits until no other live lease says ``cleaning``. Either B's lease existed before A listed
leases (A skips deletion), or B saw A cleaning and waited for it to finish — so A never deletes an object B
wrote, even though object names are deterministic and B may rewrite the name of an old orphan.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid

import fsspec
from deepinfer.pipeline.output import storage

LEASE_DIR = "_runs"


def _proc_start_time(pid: int) -> str | None:
    """The process start time (clock ticks since boot) from /proc, or None when it is not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie has exited: it writes nothing more
        return None
    return fields[19] if len(fields) > 19 else ""


def pid_namespace() -> str | None:
    """This process's pid namespace (containers on one host share its boot id and maybe its hostname,
    but not their pids), or None where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def ray_node() -> str | None:
    """The Ray node id of this process when it is connected to Ray (without importing Ray)."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # a half-initialised or shutting-down Ray: the field is informational only
        return None
    return None


def process_alive(host: str, pid: int, pid_start: str | None = None, pidns: str | None = None
                  ) -> bool | None:
    """Whether a process of this host is alive; None when ``host`` is another machine, or ``pidns`` is
    another pid namespace of this one (cannot tell: then only the heartbeat says)."""
    if host != storage.host_tag():
        return None
    if pidns is not None and pidns != pid_namespace():
        return None
    if not os.path.exists("/proc/self/stat"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    start = _proc_start_time(pid)
    if start is None:
        return False
    return pid_start is None or start == pid_start


class Lease:
    """This run's lease on one output; refreshed every ``ttl_s / 4`` seconds until :meth:`release`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, ttl_s: float = 120.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self._fs = fs
        self._root = root
        self.ttl_s = ttl_s
        self.run_id = uuid.uuid4().hex
        self.path = storage.join(root, LEASE_DIR, f"{self.run_id}.json")
        self._cleaning = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps(
            {
                "run_id": self.run_id,
                "host": storage.host_tag(),
                "pidns": pid_namespace(),
                "node": ray_node(),
                "pid": pid,
                "pid_start": _proc_start_time(pid),
                "heartbeat": time.time(),
                "cleaning": self._cleaning,
            },
            sort_keys=True,
        ).encode()

    def _write(self) -> None:
        with self._lock:
            storage.write_atomic(self._fs, self.path, self._record())

    def acquire(self) -> None:
        """Write the lease (``cleaning=True``: this run may clean up) and start the heartbeat."""
        self._write()
        name = f"deepinfer-lease-{self.run_id[:8]}"
        self._thread = threading.Thread(target=self._beat, name=name, daemon=True)
        self._thread.start()

    def set_cleaning(self, cleaning: bool) -> None:
        self._cleaning = cleaning
        self._write()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            # a failed heartbeat is not fatal here: the main thread meets the same storage error itself
            with contextlib.suppress(Exception):
                self._write()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            storage.remove(self._fs, self.path)

    def others(self) -> list[dict]:
        """The live leases of other runs; removes the dead ones it meets."""
        return [rec for rec in read_leases(self._fs, self._root, self.ttl_s) if rec["run_id"] != self.run_id]

    def wait_while_others_clean(self, timeout_s: float, poll_s: float = 0.1) -> None:
        """Block until no other live run is cleaning orphans (see the module docstring)."""
        deadline = time.monotonic() + timeout_s
        while any(rec.get("cleaning") for rec in self.others()):
            if time.monotonic() > deadline:
                from deepinfer.pipeline.errors import RetryableError

                raise RetryableError(
                    f"another run on this output has been cleaning up for over {timeout_s:.0f}s; retry later"
                )
            time.sleep(poll_s)


def read_leases(fs: fsspec.AbstractFileSystem, root: str, ttl_s: float) -> list[dict]:
    """Live lease records under ``root``; dead ones (and stale temp files of dead writers) are deleted."""
    directory = storage.join(root, LEASE_DIR)
    live = []
    now = time.time()
    for name in storage.list_names(fs, directory):
        path = storage.join(directory, name)
        tmp = storage.parse_temp_name(name)
        if tmp is not None:
            if process_alive(tmp[0], tmp[1]) is False:
                storage.remove(fs, path)
            continue
        if not name.endswith(".json"):
            continue
        data = storage.read_bytes(fs, path)
        if data is None:
            continue
        try:
            rec = json.loads(data)
            alive = process_alive(rec["host"], int(rec["pid"]), rec.get("pid_start"), rec.get("pidns"))
            fresh = now - float(rec["heartbeat"]) <= ttl_s
        except (ValueError, KeyError, TypeError):
            alive, fresh = False, False
        if alive is False or (alive is None and not fresh):
            storage.remove(fs, path)
            continue
        live.append(rec)
    return live
