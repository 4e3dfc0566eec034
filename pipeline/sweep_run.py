"""Running a sweep's points with each model built once: one engine per model on either executor.

Every point is still its own job, run by runner.run_job (its own JobStore under points/<id>/, fingerprint,
exactly-once commits, resume, error budget, _SUCCESS); only where its engine rows come from changes
(SubmitOptions.execute):

* local executor: the points run one after the other, their engine stages built from one EngineCache
  created here, so the points with the same model and engine settings share one LLM;
* Ray executor: one Ray session for the sweep; the points that share engine settings (StagePlan.engine_key
  and the runtime engine settings) form a group that runs through one Ray Data pipeline and one actor
  pool (executors/sweep_ray.py), so each engine actor builds its model once for the whole group. Each
  point's run_job runs in a thread of its own, the way it would run alone; the group starts once every
  point has either asked for its parts still to run or finished without any (complete, or refused), and
  the driver routes each finished part's rows to its point. A point that stops early (error budget)
  stops taking rows; the rest go on.

Errors: a point's exception is recorded by its run_job (_FAILED) and re-raised here after the group
(the first, in point order), as a sequential run would raise it; an interrupt (Ctrl-C, SIGTERM) ends
every point of the group as interrupted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

_END = object()  # no more rows for this point


class _Feed:
    """The rows of one point of a Ray group, from the group's driver loop to the point's run_job."""

    def __init__(self, plan: Any, parts: list) -> None:
        self.plan, self.parts = plan, parts
        self.rows: queue.Queue = queue.Queue(maxsize=4)  # back-pressure: the driver holds few blocks
        self.closed = threading.Event()

    def put(self, item: object) -> None:
        """Hand `item` to the point unless it has stopped taking rows (then it is dropped)."""
        while not self.closed.is_set():
            try:
                self.rows.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # The point's run_job iterates the feed and closes it when it ends, early or not (runner._run_parts);
    # an iterator object rather than a generator, so that close() counts even before the first row.
    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> pa.Table:
        item = self.rows.get()
        if item is _END or isinstance(item, BaseException):
            self.closed.set()
            if item is _END:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        self.closed.set()


class _Group:
    """One Ray group: its points' threads, the barrier before the pipeline starts, and their feeds."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.cond = threading.Condition()
        self.waiting = set(keys)  # neither registered their parts nor finished
        self.feeds: dict[str, _Feed] = {}
        self.aborted: BaseException | None = None

    def executor_for(self, key: str):
        def execute(spec: Any, plan: Any, parts: list, options: Any) -> Iterator[pa.Table]:
            feed = _Feed(plan, list(parts))
            with self.cond:
                if self.aborted is not None:
                    feed.put(self.aborted)
                self.feeds[key] = feed
                self.waiting.discard(key)
                self.cond.notify_all()
            return feed
        return execute

    def finished(self, key: str) -> None:
        with self.cond:
            self.waiting.discard(key)
            self.cond.notify_all()

    def wait_ready(self) -> None:
        with self.cond:
            while self.waiting:
                self.cond.wait(timeout=0.5)

    def abort(self, exc: BaseException) -> None:
        with self.cond:
            self.aborted = exc
            feeds = list(self.feeds.values())
        for feed in feeds:
            feed.put(exc)


def _engine_group_key(spec: Any) -> str:
    import json

    from deepinfer.pipeline.stages.plan import StagePlan

    r = spec.runtime
    return json.dumps([StagePlan.from_spec(spec).engine_key(), r.engines, r.engine_cpus,
                       r.max_batches_in_flight], default=str)


def run_points(points: Sequence[tuple[Any, Any]], options: Any) -> dict[str, int]:
    """Run every (SweepPoint, JobSpec) point; returns {point id: exit code}. Raises the first point's
    exception (in point order) after the points that could run have run."""
    from deepinfer.pipeline.stages.generate import EngineCache

    codes: dict[str, int] = {}
    local = [(p, s) for p, s in points if s.runtime.executor != "ray"]
    ray_points = [(p, s) for p, s in points if s.runtime.executor == "ray"]
    if local:
        codes.update(_run_local_points(local, options, EngineCache()))
    if ray_points:
        codes.update(_run_ray_points(ray_points, options))
    return {p.id: codes[p.id] for p, _ in points}


def _run_local_points(points: Sequence[tuple[Any, Any]], options: Any, engines: Any) -> dict[str, int]:
    import sys

    from deepinfer.pipeline.executors.local import run_local
    from deepinfer.pipeline.runner import run_job

    def execute(spec: Any, plan: Any, parts: list, opts: Any) -> Iterator[pa.Table]:
        return run_local(plan, parts, engines)

    codes = {}
    for i, (point, spec) in enumerate(points):
        print(f"[deepinfer] sweep point {i + 1}/{len(points)}: {point.id}", file=sys.stderr)
        codes[point.id] = run_job(spec, replace(options, summary_json=None, execute=execute))
    return codes


def _run_ray_points(points: Sequence[tuple[Any, Any]], options: Any) -> dict[str, int]:
    from deepinfer.pipeline.cli.main import install_signal_handlers
    from deepinfer.pipeline.executors.ray_data import connect

    groups: dict[str, list[tuple[Any, Any]]] = {}
    for point, spec in points:
        groups.setdefault(_engine_group_key(spec), []).append((point, spec))
    session = connect(options.address, options.verbose)
    install_signal_handlers()  # ray.init replaced the SIGTERM handler
    codes: dict[str, int] = {}
    try:
        for members in groups.values():
            codes.update(_run_group(members, options, session))
    finally:
        session.close()
    return codes


def _run_group(members: Sequence[tuple[Any, Any]], options: Any, session: Any) -> dict[str, int]:
    import sys

    from deepinfer.pipeline.executors.ray_data import EngineSettings
    from deepinfer.pipeline.executors.sweep_ray import run_ray_group
    from deepinfer.pipeline.runner import run_job

    keys = [str(i) for i in range(len(members))]
    group = _Group(keys)
    results: dict[str, int | BaseException] = {}

    def run_point(key: str, spec: Any) -> None:
        try:
            results[key] = run_job(spec, replace(options, summary_json=None, execute=group.executor_for(key)))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the driver thread below
            results[key] = exc
        finally:
            group.finished(key)

    print(f"[deepinfer] sweep: {len(members)} points share one engine pool: "
          f"{', '.join(p.id for p, _ in members)}", file=sys.stderr)
    threads = [threading.Thread(target=run_point, args=(k, s), name=f"sweep-point-{p.id}", daemon=True)
               for k, (p, s) in zip(keys, members)]
    for t in threads:
        t.start()
    try:
        group.wait_ready()
        feeds = dict(group.feeds)
        if feeds:
            r = members[0][1].runtime
            settings = EngineSettings(r.engines, r.engine_cpus, r.max_batches_in_flight)
            plans = {k: f.plan for k, f in feeds.items()}
            try:
                for key, rows in run_ray_group(plans, {k: f.parts for k, f in feeds.items()}, session,
                                               settings):
                    feeds[key].put(rows)
            except Exception as exc:  # noqa: BLE001 - every point of the group fails with it
                group.abort(exc)
            for feed in feeds.values():
                feed.put(_END)
        for t in threads:
            t.join()
    except BaseException as exc:  # an interrupt: end every point, then raise it here
        group.abort(exc)
        for t in threads:
            t.join(timeout=30)
        raise
    for key in keys:  # the first failure in point order, as a sequential run would stop on it
        if isinstance(results.get(key), BaseException):
            raise results[key]
    return {p.id: results[k] for k, (p, _) in zip(keys, members)}
