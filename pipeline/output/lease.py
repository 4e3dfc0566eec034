"""Run leases: which runs are live on an output, so that orphan cleanup never races a live writer.

Each process that may write to an output holds ``_runs/{run_id}.json``:
``{"run_id", "host", "pidns", "node", "pid", "pid_start", "heartbeat", "cleaning", "role", "driver",
"parts"}``, refreshed by a heartbeat thread. ``role`` is "run" for a job's driver and "committer" for a
process that commits parts for a driver (a Ray engine actor: worker_commit.py), whose ``driver`` names
the driver's run id and whose ``parts`` lists the parts it is working on now (for `status` and for
debugging a cluster run: which node had which part in flight). A lease is dead when its process is
gone (same host and pid namespace: checked through /proc, including pid reuse via the process start
time) or its heartbeat is older than ``ttl_s`` (other hosts, and other containers of this host, whose
pids /proc here does not show). Dead leases are removed by whoever notices. ``node`` is the Ray node id
of the process when it is attached to Ray (or null), for `status`.

Across nodes the heartbeat is the only liveness signal, compared with this machine's clock: clocks must
agree to well within ``ttl_s`` (120 s; NTP keeps them within milliseconds). A driver whose node dies
stops beating; its lease goes stale after ``ttl_s`` and the next run's cleanup proceeds then.

Fencing: a writer commits a part only while its own lease is fresh. :meth:`Lease.held_since` is true
when every heartbeat since a moment (the start of the part's data writes) succeeded within ``ttl_s / 2``
of the previous one and the last one is that recent, so no other run can have judged this lease dead
(older than ``ttl_s``) meanwhile, with half the TTL left for clock skew and the marker's PUT. A runner
whose heartbeats stalled (storage unreachable, process paused) refuses to commit (exit 75) instead.

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

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, ttl_s: float = 120.0, *,
                 role: str = "run", driver: str | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        if role not in ("run", "committer"):
            raise ValueError(f"lease role must be 'run' or 'committer', got {role!r}")
        self._fs = fs
        self._root = root
        self.ttl_s = ttl_s
        self.run_id = uuid.uuid4().hex
        self.path = storage.join(root, LEASE_DIR, f"{self.run_id}.json")
        # A run may clean up orphans from its first write on; a committer never cleans.
        self._cleaning = role == "run"
        self.role, self.driver = role, driver
        self._parts: list[str] = []
        self._last_ok: float | None = None  # time.monotonic() at the start of the last successful write
        self._lapse_end: float | None = None  # end of the latest gap longer than ttl_s / 2 between writes
        self._lost = False  # a committer's lease that someone removed: it writes and commits no more
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
                "role": self.role,
                "driver": self.driver,
                "parts": list(self._parts),
            },
            sort_keys=True,
        ).encode()

    def _write(self) -> None:
        with self._lock:
            if self._lost:
                return
            started = time.monotonic()
            storage.write_atomic(self._fs, self.path, self._record())
            if self._last_ok is not None and started - self._last_ok > self.ttl_s / 2:
                self._lapse_end = started  # others may have seen this lease stale in between
            self._last_ok = started

    def held_since(self, since: float) -> bool:
        """Whether this lease has been kept fresh without a gap from `since` (time.monotonic()) until now:
        the fence a writer checks before it commits (module docstring)."""
        with self._lock:
            now = time.monotonic()
            if self._last_ok is None or now - self._last_ok > self.ttl_s / 2:
                return False
            return self._lapse_end is None or self._lapse_end <= since

    def set_parts(self, parts: list[str]) -> None:
        """Record the parts this writer works on now (a committer, at the start of each part)."""
        self._parts = list(parts)
        self._write()

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
                # A committer's lease is removed only by its driver (every part committed) or by a run
                # that judged it dead: either way it is over; beating on would resurrect it.
                if self.role == "committer" and storage.read_bytes(self._fs, self.path) is None:
                    with self._lock:
                        self._lost, self._last_ok = True, None
                    return
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


def remove_committers(fs: fsspec.AbstractFileSystem, root: str, driver: str) -> int:
    """Delete the committer leases of the run `driver` (its engine actors' leases, which Ray may end
    without a goodbye). Only for a run whose every part is committed: a committer can then write only
    names a marker already references, which cleanup never deletes. Returns how many were removed."""
    directory = storage.join(root, LEASE_DIR)
    removed = 0
    for name in storage.list_names(fs, directory):
        if not name.endswith(".json") or storage.parse_temp_name(name) is not None:
            continue
        path = storage.join(directory, name)
        data = storage.read_bytes(fs, path)
        try:
            rec = json.loads(data) if data is not None else None
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("role") == "committer" and rec.get("driver") == driver:
            removed += int(storage.remove(fs, path))
    return removed
