"""One local Ray instance shared by the test modules that run jobs on Ray, instead of one per module.

Starting Ray (GCS, raylet, their agents) and its first worker processes (each importing torch) costs tens of
seconds on a loaded 2-core CI machine; the modules that only need "a local Ray with 2 CPUs" (in-process
submits on the Ray executor, or submit subprocesses attached by address) share one through the session
fixture `shared_ray` (tests/conftest.py): a `LocalRay` kept in the session's stash, started by the first test
that asks, stopped after the last test that uses it (tests/conftest.py runs those modules one after the
other) and by `stop_shared_ray` before a module that needs a Ray cluster of its own starts one.
"""

from __future__ import annotations

import logging

import pytest

FIXTURE = "shared_ray"
SHARED = pytest.StashKey["LocalRay"]()
LAST_USER = pytest.StashKey["str | None"]()


class LocalRay:
    """The session's local Ray: `start()` attaches this process to it (starting it if needed), `stop()`
    shuts it down (a later `start()` starts a fresh one)."""

    def __init__(self) -> None:
        self._running = False

    def start(self) -> str:
        """Start (once) a local Ray with 2 CPUs in this process; its GCS address, for subprocess drivers."""
        ray = pytest.importorskip("ray")
        if not self._running:
            if ray.is_initialized():
                pytest.skip("this process is attached to a Ray instance the test suite did not start")
            # Workers inherit this process's environment as of now: tests that change it for workers need
            # a Ray of their own.
            # "local": a Ray of its own, even where another cluster's processes or address file are left
            # on the machine (Ray would attach to those and refuse num_cpus).
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
                     log_to_driver=False)
            self._running = True
        return ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        if self._running:
            import ray

            ray.shutdown()
            self._running = False


def stop_shared_ray(config: pytest.Config) -> None:
    """Shut the shared local Ray down if it runs (for a test that needs this process detached from Ray)."""
    if SHARED in config.stash:
        config.stash[SHARED].stop()


def group_ray_modules(items: list[pytest.Item]) -> str | None:
    """Reorder `items` in place so that the modules with tests using the shared Ray run one after the
    other, at the place of the first (within a module, the order is kept); the node id of the last test
    that uses it, after which it can be stopped (None: no test uses it)."""
    users = [i for i in items if FIXTURE in getattr(i, "fixturenames", ())]
    if not users:
        return None
    modules = {u.nodeid.split("::")[0] for u in users}
    first = items.index(users[0])
    grouped = [i for i in items[first:] if i.nodeid.split("::")[0] in modules]
    rest = [i for i in items[first:] if i.nodeid.split("::")[0] not in modules]
    items[first:] = grouped + rest
    return [i for i in grouped if FIXTURE in getattr(i, "fixturenames", ())][-1].nodeid
