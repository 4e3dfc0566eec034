"""Starting Ray while the driver does its own start-up work, and stopping it once the run is reported.

`ray.init` of a local cluster (GCS, raylet, their agents) takes seconds; the driver meanwhile checks the
model, lists the input, plans parts, reads the duplicate-id verdict and opens the output store, none of
which needs Ray. `RayStarter` runs the connection on a thread from the start of `run_job` and hands the
session to the executor when it needs it; `close()` (after the summary is written and printed, so the
exit code is final) shuts a local Ray down, which otherwise would sit between the last commit and the
summary.

The thread lives until `close()`: Ray starts its local head processes (GCS, raylet) with a parent-death
signal (PR_SET_PDEATHSIG), which Linux sends when the parent *thread* ends, so a thread that returned
after `ray.init` would take the local cluster down with it.

A second thread imports ray.data while ray.init waits for the local cluster's processes (the session's
configuration needs it right after). Thread-safety: the driver's other work in that window touches no Ray
state. `connect` redirects file descriptor 2 while Ray starts (ray_data._quiet_stderr); anything the
driver prints then is written out once Ray is up, so `close()` is called on every path out of `run_job`,
error paths included, before the CLI prints an error.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from deepinfer.pipeline.errors import SpecError
from deepinfer.pipeline.executors.ray_data import (
    RaySession,
    attaches_to_cluster,
    check_cluster_storage,
    connect,
    storage_problems,
)


class RayStarter:
    """`connect(address, verbose)` on a background thread; `session()` waits for it (re-raising its
    error in the caller), `close()` waits for it and shuts down the Ray this run started."""

    def __init__(self, address: str | None, verbose: bool) -> None:
        self.address, self.verbose = address, verbose
        self._session: RaySession | None = None
        self._error: BaseException | None = None
        self.ready_at: float | None = None  # time.time() when Ray was up
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._connect, name="deepinfer-ray-start", daemon=True)
        self._thread.start()
        # `import ray.data` (~1-1.5 s of Python) would otherwise run after ray.init on the start thread
        # (configure_data_context); ray.init spends most of its time waiting for the GCS and raylet
        # processes, so the import runs beside it. A failure here is left to that later import to report.
        threading.Thread(target=_import_ray_data, name="deepinfer-ray-data-import", daemon=True).start()

    def _connect(self) -> None:
        try:
            self._session = connect(self.address, self.verbose)
            self.ready_at = time.time()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that asks for the session
            self._error = exc
        finally:
            self._ready.set()
        self._stop.wait()  # keep the local Ray's parent thread alive (module docstring)

    def session(self) -> RaySession:
        """The connected session (waits for the start to finish); the start's exception if it failed."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._session is not None
        return self._session

    def close(self) -> None:
        """Shut down the Ray this run started (waits for a start still under way); idempotent."""
        self._ready.wait()
        session, self._session = self._session, None
        try:
            if session is not None:
                session.close()
        finally:
            self._stop.set()
            self._thread.join()


def _import_ray_data() -> None:
    try:
        import ray.data  # noqa: F401
    except BaseException:  # noqa: BLE001 - re-raised where the session is configured (ray_data.connect)
        pass


def start_early(output_path: str, storage_options: dict, options: Any) -> tuple[RayStarter | None, bool]:
    """(a started RayStarter or None, whether the run attaches to an existing cluster) for a submit with
    `options` (runner.SubmitOptions). None when the output already holds `_SUCCESS` (a rerun of a complete
    job has nothing to run: it would wait for a Ray start and shutdown it never needs; if the job there
    turns out to differ, the executor connects when it runs, as without a starter)."""
    attaching = attaches_to_cluster(options.address)  # before the starter's thread makes Ray initialized
    if not options.restart and _has_success(output_path, storage_options):
        return None, attaching
    return RayStarter(options.address, options.verbose), attaching


def _has_success(output_path: str, storage_options: dict) -> bool:
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import SUCCESS_FILE

    try:
        fs, root = storage.open_fs(output_path, storage_options)
        return bool(fs.exists(storage.join(root, SUCCESS_FILE)))
    except Exception:  # noqa: BLE001 - best effort: JobStore.open reports real problems with the path
        return False


def check_storage(input_path: str, output_path: str, shared_filesystem: bool, address: str | None,
                  verbose: bool, starter: RayStarter | None, attaching: bool) -> None:
    """ray_data.check_cluster_storage, on `starter`'s session when there is one: `attaching` (decided
    before the starter ran, since its thread makes `ray.is_initialized()` true) says whether the run
    attaches to an existing cluster, the only case that can have several nodes."""
    if starter is None:
        check_cluster_storage(input_path, output_path, shared_filesystem, address, verbose)
        return
    if attaching:
        problems = storage_problems(input_path, output_path, shared_filesystem, starter.session())
        if problems:
            raise SpecError(problems)
