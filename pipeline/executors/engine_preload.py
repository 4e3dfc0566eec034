"""Loading the engine's native parts (torch's libraries, CUDA's context, Triton) beside the driver's work.

Opt-in (`DEEPINFER_ENGINE_PRELOAD=1`, see PRELOAD_ENV): its gain on a GPU host is not measured yet.

On the in-process executor the engine is built on the driver's thread once the input is planned and the
output opened: `import deepinfer.engine.llm` (torch and the CUDA libraries: 3-4 s on a GPU host), then
CUDA's context inside LLM(), then Triton's import inside the first step's kernels. Much of that is native
work that needs no Python: mapping and relocating shared libraries, creating the CUDA context. So
`EnginePreload` does it on a daemon thread from the moment the submit knows its run is local and has its
own modules (cli/main.py; run_job for in-process callers), without the GIL:

1. torch's first shared libraries (libtorch_global_deps, with the CUDA libraries it links, and
   libtorch_cpu: torch_libraries says which and why) are opened by libc's dlopen called through ctypes,
   which releases the GIL while the loader works (an extension module's dlopen inside `import` holds
   it); the later import finds them loaded (dlopen of a loaded library only counts a reference). While
   it runs, an extension import on the driver's thread waits for libc's loader lock: the CLI starts the
   preload after its own imports (pyarrow, its filesystems, tokenizers, pandas), so what runs beside it
   is the driver's Python (model checks, input listing and planning, the output store);
2. for a CUDA model, the device's primary context is created through the driver API (cuInit,
   cuDevicePrimaryCtxRetain; ctypes calls, again without the GIL): the context torch's runtime then uses;
3. once the driver's thread has imported the engine (`engine_imported()`, called by the local executor as
   the model build starts), for a CUDA model Triton: libtriton opened as above, then `import triton`,
   Python work that would otherwise fall in the first step, here beside the weights being streamed
   (reader threads, mostly without the GIL).

The Python side of torch's import stays on the driver's thread, after its own work, as before: running it
here too would only interleave two GIL-bound threads. Nothing changes what runs, only when: the same
libraries are loaded (RTLD_LOCAL: torch's import then makes libtorch_global_deps global itself, as it
always does), the same context created. Nothing is raised here: a step that fails is recorded in
`error` and the rest skipped; the engine's own import or LLM() then fails on the driver's thread as it
did without a preload, with its exit code. Marks (epochs) go to the run summary's startup
(engine_preload_*_s).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Set to 1 to run the preload. Off by default: on the H200 (2026-12-02) the one end-to-end run with it on
# was cut by its time limit before it ended, so neither its gain nor the absence of a stall is shown yet
# (A/B: benchmarks/bench_pipeline.py --arms local, with and without DEEPINFER_ENGINE_PRELOAD=1).
PRELOAD_ENV = "DEEPINFER_ENGINE_PRELOAD"


def preload_enabled(env: dict[str, str] | None = None) -> bool:
    """True when $DEEPINFER_ENGINE_PRELOAD is 1/true/yes/on (unset: off)."""
    value = (os.environ if env is None else env).get(PRELOAD_ENV, "0").strip().lower()
    return value in ("1", "true", "yes", "on")


def cuda_ordinal(device: str) -> int | None:
    """The CUDA device ordinal a spec's model.device may start ('auto' and 'cuda': 0), None for 'cpu'."""
    if device in ("auto", "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def package_dir(name: str) -> Path | None:
    """Where package `name` is installed, found without importing it; None when it is not."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def torch_libraries() -> list[Path]:
    """The shared libraries `import torch` opens first, in its order: libtorch_global_deps (the CUDA
    runtime libraries it links: cuBLAS, cuDNN, NCCL, ... on a CUDA build) and libtorch_cpu (with c10).

    Not libtorch_cuda: torch's import opens it only after preloading its own nvJitLink/NVRTC (a
    workaround for cuSPARSE picking another CUDA's copy from $LD_LIBRARY_PATH, pytorch#138460); opened
    here first, its dependencies could resolve differently. The libraries opened here resolve as they
    would inside the import: nothing of torch's is loaded before them there either."""
    root = package_dir("torch")
    if root is None:
        return []
    return [p for p in (root / "lib" / name for name in ("libtorch_global_deps.so", "libtorch_cpu.so"))
            if p.is_file()]


def triton_libraries() -> list[Path]:
    """Triton's compiler library (an extension module, opened here only as a shared library)."""
    root = package_dir("triton")
    return sorted((root / "_C").glob("libtriton*.so")) if root is not None and (root / "_C").is_dir() else []


def _libc_dlopen() -> Callable[[bytes, int], int | None]:
    libc = ctypes.CDLL(None)
    fn = libc.dlopen
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    return fn


def dlopen_without_gil(libraries: list[Path | str]) -> int:
    """Open `libraries` (paths, or names the loader searches for) with libc's dlopen, RTLD_NOW |
    RTLD_LOCAL, through a ctypes foreign call, which runs without the GIL; returns how many opened. One
    that fails to open is skipped: the import that needs it reports the problem itself. The handles are
    kept for the process's life, as an import keeps them."""
    if not libraries:
        return 0
    dlopen = _libc_dlopen()
    return sum(1 for lib in libraries if dlopen(os.fsencode(lib), os.RTLD_NOW | os.RTLD_LOCAL))


def retain_primary_context(ordinal: int) -> bool:
    """Create (retain) device `ordinal`'s primary CUDA context through the driver API, without the GIL;
    False where there is no CUDA driver or device (LLM() then says what is wrong itself)."""
    if not dlopen_without_gil(["libcuda.so.1"]):
        return False
    cuda = ctypes.CDLL("libcuda.so.1")  # already loaded: no loader work under the GIL
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    return (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
            and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0)


def _import_triton() -> None:
    # libtriton (LLVM and MLIR: hundreds of MB) only now: its load holds libc's loader lock, which an
    # extension import on the driver's thread (torch's own) would otherwise wait for
    dlopen_without_gil(triton_libraries())
    import triton  # noqa: F401 - what the first step's kernels import
    import triton.language  # noqa: F401


class EnginePreload:
    """Load the engine's native parts on a daemon thread started by the constructor (module docstring):
    `native()` (the libraries), then `start_cuda(ordinal)` when `ordinal` is not None; `engine_imported()`
    adds `triton()` on a second thread, after the first and only when a context is up. The callables
    default to the real steps (tests pass their own).

    `marks` (epochs): "started", "native" (libraries opened), "cuda" (a context is up), "triton"; a step
    that did not happen has no mark. `error` holds what failed (what needed it raises it again itself).
    `join()` waits for the threads started so far.
    """

    def __init__(self, ordinal: int | None, native: Callable[[], object] | None = None,
                 start_cuda: Callable[[int], bool] | None = None,
                 triton: Callable[[], None] | None = None) -> None:
        self.ordinal = ordinal
        self._native = native or (lambda: dlopen_without_gil(torch_libraries()))
        self._start_cuda = start_cuda or retain_primary_context
        self._triton = triton or _import_triton
        self.marks: dict[str, float] = {"started": time.time()}
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name="deepinfer-engine-preload", daemon=True)]
        self._threads[0].start()

    def engine_imported(self) -> None:
        """The driver's thread has imported the engine: import Triton on a second thread once the first
        has CUDA up (the first call only; nothing without CUDA)."""
        with self._lock:
            if len(self._threads) > 1:
                return
            self._threads.append(threading.Thread(target=self._run_triton, name="deepinfer-engine-preload",
                                                  daemon=True))
            self._threads[1].start()

    def _run(self) -> None:
        try:
            self._native()
            self.marks["native"] = time.time()
            if self.ordinal is not None and self._start_cuda(self.ordinal):
                self.marks["cuda"] = time.time()
        except BaseException as exc:  # noqa: BLE001 - raised again by the engine's own import / LLM()
            self.error = exc

    def _run_triton(self) -> None:
        self._threads[0].join()
        try:
            if "cuda" in self.marks:
                self._triton()
                self.marks["triton"] = time.time()
        except BaseException as exc:  # noqa: BLE001 - raised again where a kernel imports Triton
            self.error = exc

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the threads started so far (at most `timeout` s each); True when they ended."""
        for thread in list(self._threads):
            thread.join(timeout)
        return not any(t.is_alive() for t in self._threads)


def start_engine_preload(device: str) -> EnginePreload:
    """An EnginePreload of the real engine for a model on `device` (spec model.device)."""
    return EnginePreload(cuda_ordinal(device))


def load_driver_extensions() -> None:
    """Import the extension modules the driver's own work loads later anyway — the tokenizer's
    (`tokenizers`, model checks) and pandas (pyarrow imports it, when installed, on its first array built
    from a Python list) — before a preload starts: its dlopen holds libc's loader lock, which their
    imports would otherwise wait for, holding the GIL, in the middle of the driver's work."""
    import pyarrow as pa
    from deepinfer.engine.text import tokenizer  # noqa: F401 - `tokenizers`

    pa.array([0])


def _wanted(spec: Any, executor_replaced: bool) -> bool:
    return (spec.runtime.executor == "local" and not executor_replaced
            and not spec.runtime.benchmark_stub_engine and preload_enabled())


def preload_for(spec: Any, given: EnginePreload | None, executor_replaced: bool) -> EnginePreload | None:
    """The preload of a run of `spec` (a JobSpec whose runtime.executor is decided): `given` when the
    caller started it (cli/main.py), else one started now; None on Ray, for a stub engine, for a run whose
    executor a caller replaced (a sweep's points share one engine), or without $DEEPINFER_ENGINE_PRELOAD=1."""
    if not _wanted(spec, executor_replaced):
        return None
    return given or start_engine_preload(spec.model.device)


def start_for_submit(spec: Any) -> EnginePreload | None:
    """The CLI's preload for `spec` (executor decided), started before the run's clock, once the
    extension modules the driver's work loads anyway are in (load_driver_extensions); None as
    preload_for."""
    if not _wanted(spec, False):
        return None
    load_driver_extensions()
    return start_engine_preload(spec.model.device)
