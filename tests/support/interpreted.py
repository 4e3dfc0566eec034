"""Triton-interpreter kernel tests: the launcher on the CPU side and the preamble of each *_interpreted.py.

Triton decides at import time whether @triton.jit functions (its standard library's included) are compiled
or interpreted, so a tests/kernels/test_*_interpreted.py file only means something in a process started
with TRITON_INTERPRET=1. A launcher test in the matching test_*_cpu.py starts that process:

    @launches("tests/kernels/test_mla_decode_interpreted.py")
    def test_mla_kernels_pass_under_interpreter(request):
        run_interpreted(request, "MLA kernel")

Every process started that way pays for a new Python importing torch, triton and pytest's plugins (seconds
on a 2-core CI machine), so a session starts ONE process for the interpreted files of every launcher it
collected, and each launcher then checks its own file's results (the junit report of that run, kept in the
session's stash). A session that collected one launcher runs one file.

That process starts in the background as soon as collection ends (`start_batch`, from tests/conftest.py),
so on a multi-core machine it runs beside the rest of the suite (on the 2-core CI machine the suite took
12:18 instead of 14:49); the first launcher waits for it. Under pytest-xdist (each worker collects
everything) the first launcher to run starts it instead.

The interpreted file itself begins with `skip_unless_interpreting(...)` and gets its kernel module through
`interpreted_kernels(...)`, which checks the kernels really were built for the interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "interpreted"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# One process runs every collected file: the sum of their runtimes, with room for a loaded machine.
TIMEOUT_S = 600
_F = TypeVar("_F", bound=Callable[..., object])


@dataclass
class FileResult:
    """One interpreted file's outcome in the shared run: test names by outcome, and failure texts."""

    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class Batch:
    """The shared run of a session: each file's result, and the process's exit code and output tail."""

    results: dict[str, FileResult]
    returncode: int
    tail: str


_BATCH = pytest.StashKey[Batch]()


def launches(*paths: str) -> Callable[[_F], _F]:
    """Decorator of a launcher test: marks the interpreted files it runs (repository-relative paths) and
    skips where they need not run (TRITON_INTERPRET=1: pytest collects them directly)."""
    missing = [p for p in paths if not (ROOT / p).is_file()]
    if not paths or missing:
        raise ValueError(f"launches{paths!r}: no such file under {ROOT}: {missing}; give one or more "
                         "repository-relative paths")

    def wrap(test: _F) -> _F:
        test = pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1 already set: pytest collects "
                                  "the interpreted tests directly")(test)
        return getattr(pytest.mark, MARKER)(*paths)(test)

    return wrap


def _wanted(session: pytest.Session) -> list[str]:
    """The interpreted files of every launcher this session collected, in collection order."""
    paths: list[str] = []
    for item in session.items:
        mark = item.get_closest_marker(MARKER)
        if mark is not None:
            paths.extend(p for p in mark.args if p not in paths)
    return paths


def _module_of(path: str) -> str:
    """The junit classname prefix of a file's tests: its path as a dotted module name."""
    return path.removesuffix(".py").replace("/", ".")


def _parse(report: Path, paths: list[str]) -> dict[str, FileResult]:
    results = {p: FileResult() for p in paths}
    modules = {_module_of(p): p for p in paths}
    for case in ET.parse(report).iter("testcase"):
        # A collection error or module-level skip is reported with no classname, the module as its name.
        name = case.get("name", "")
        where = case.get("classname", "") or name
        owner = next((p for m, p in modules.items() if where == m or where.startswith(m + ".")), None)
        if owner is None:
            continue
        res = results[owner]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            res.failed[name] = f"{bad.get('message', '')}\n{bad.text or ''}"
        elif case.find("skipped") is not None:
            res.skipped.append(f"{name}: {case.find('skipped').get('message', '')}")
        else:
            res.passed.append(name)
    return results


@dataclass
class _Running:
    """A batch started in the background: its process, report directory and files."""

    proc: subprocess.Popen
    tmp: Path
    paths: list[str]

    def wait(self) -> Batch:
        note = ""
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            note = f"\n(killed after {TIMEOUT_S} s)"
        try:
            out = (self.tmp / "output.txt").read_text(errors="replace") + note
            report = self.tmp / "junit.xml"
            results = _parse(report, self.paths) if report.exists() else {}
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return Batch(results, self.proc.returncode, out[-8000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


_RUNNING = pytest.StashKey[_Running]()


def _start(paths: list[str]) -> _Running:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="interpreted-"))
    # A file that fails to import must not stop the others (each launcher reports its own file);
    # junit_family xunit1: classnames are dotted module paths, which name each test's file.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-o", "junit_family=xunit1", f"--junitxml={tmp / 'junit.xml'}",
           *paths]
    # Output to a file, not a pipe: nobody reads a pipe while the suite runs, and a full one would stall it.
    with open(tmp / "output.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return _Running(proc, tmp, paths)


def start_batch(session: pytest.Session) -> None:
    """Start the session's interpreted batch in the background (pytest_collection_finish): nothing to do
    when this process interprets already, no launcher was collected, Triton is absent, or this is an xdist
    worker (which runs only some launchers; the first of them starts what it needs)."""
    if INTERPRETING or os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("triton") is None:
        return
    wanted = _wanted(session)
    if wanted:
        session.stash[_RUNNING] = _start(wanted)


def stop_batch(session: pytest.Session) -> None:
    """Kill a background batch no launcher waited for (an interrupted or filtered-down session)."""
    running = session.stash.get(_RUNNING, None)
    if running is not None:
        running.stop()
        del session.stash[_RUNNING]


def run_interpreted(request: pytest.FixtureRequest, what: str, *, allow_skips: bool = True) -> None:
    """Fail unless every test of the launcher's interpreted files passed under TRITON_INTERPRET=1 (skips
    allowed only with `allow_skips`); `what` names the kernels in the failure message."""
    pytest.importorskip("triton")
    mark = request.node.get_closest_marker(MARKER)
    if mark is None:
        raise ValueError(f"{request.node.nodeid}: decorate the launcher with @launches(path, ...)")
    stash = request.session.stash
    if _BATCH not in stash and _RUNNING in stash:
        stash[_BATCH] = stash[_RUNNING].wait()
        del stash[_RUNNING]
    if _BATCH not in stash or any(p not in stash[_BATCH].results for p in mark.args):
        wanted = _wanted(request.session)
        stash[_BATCH] = _start(wanted if set(mark.args) <= set(wanted) else list(mark.args)).wait()
    for path in mark.args:
        _check(stash[_BATCH], path, what, allow_skips)


def _check(batch: Batch, path: str, what: str, allow_skips: bool) -> None:
    res = batch.results.get(path)
    assert res is not None, f"interpreted {what} tests: the run left no report (exit {batch.returncode}):\n" \
                            f"{batch.tail}"
    failures = "\n\n".join(f"{name}:\n{text[-3000:]}" for name, text in res.failed.items())
    assert not res.failed, f"interpreted {what} tests failed ({path}):\n{failures}"
    assert res.passed, f"interpreted {what} tests: none passed in {path}:\n{res.skipped}\n{batch.tail}"
    assert allow_skips or not res.skipped, f"interpreted {what} tests skipped: {res.skipped}"


def skip_unless_interpreting(launcher: str) -> None:
    """Preamble of an interpreted file: skip the module unless this process interprets Triton kernels;
    when it does, make the interpreter's `tl.dot` independent of its operands' memory layout."""
    if not INTERPRETING:
        pytest.skip(f"runs in a subprocess with TRITON_INTERPRET=1, started by {launcher}",
                    allow_module_level=True)
    _layout_independent_dot()


def _layout_independent_dot() -> None:
    """The interpreter computes `tl.dot` with numpy's matmul on the operand tiles as they were loaded, and
    OpenBLAS picks its kernel by the operands' strides: on some CPUs (AVX-512 ones, e.g. AMD EPYC Zen 4)
    a transposed or strided tile goes through a kernel that sums K in another order, so two kernels doing
    the same tile products (a TMA-descriptor load and a pointer load of one tile) differed in the last bit
    under the interpreter, on those machines only. A GPU's MMA does not care how its tile was laid out in
    memory; giving numpy contiguous copies makes the interpreter agree, so the tests that compare kernels
    bit for bit compare their arithmetic, not the host's BLAS dispatch. Values are unchanged."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_deepinfer_contiguous", False):
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a = interpreter.TensorHandle(np.ascontiguousarray(a.data), a.dtype)
        b = interpreter.TensorHandle(np.ascontiguousarray(b.data), b.dtype)
        return plain(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._deepinfer_contiguous = True
    builder.create_dot = create_dot


def interpreted_kernels(module: str, *kernels: str) -> ModuleType:
    """deepinfer.kernels.<module> (the test skips without triton), after checking that its kernels (those
    named, else every module-level `_*_kernel`) were built for the interpreter, not compiled for a GPU."""
    pytest.importorskip("triton")
    mod = importlib.import_module(f"deepinfer.kernels.{module}")
    names = kernels or tuple(k for k in vars(mod) if k.startswith("_") and k.endswith("_kernel"))
    built = {name: type(getattr(mod, name)).__name__ for name in names}
    assert built and all(kind == "InterpretedFunction" for kind in built.values()), (
        f"{module}: kernels {built} were compiled for a GPU, not built for the interpreter (Triton was "
        "imported before TRITON_INTERPRET=1 was set)")
    return mod
