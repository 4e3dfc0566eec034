"""Which executor a submit runs on: `runtime.executor`, with 'auto' (the default) decided here.

'auto' picks the in-process executor (local.py) when the job runs one engine on this machine and no Ray
cluster is named, and Ray Data (ray_data.py) otherwise:

* a cluster is named — `--address`, $RAY_ADDRESS, or this process already connected to Ray — : Ray, so
  the job uses the cluster it was pointed at;
* else the engine count is the one a local Ray run would use (ray_data.engine_count on this machine):
  runtime.engines when set, else one engine per model.tensor_parallel_size GPUs, else one CPU engine.
  One engine: local (it skips Ray's start, the actor process and its imports: seconds of fixed cost per
  job, and the engine's output bytes are the same on both executors); more: Ray, so every GPU works.

GPUs are counted without importing torch or starting CUDA in the driver: $CUDA_VISIBLE_DEVICES when it
is set (the devices Ray would see too), else the NVIDIA device nodes /dev/nvidia0, /dev/nvidia1, ...
(in a container, the GPUs it was given). A machine without NVIDIA devices counts 0 (CPU engines).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

_DEVICE_NODE = re.compile(r"nvidia\d+")


@dataclass(frozen=True)
class ExecutorChoice:
    """The executor a run uses (`name`: 'local' or 'ray') and why (the run summary's `executor`)."""

    name: str
    reason: str

    def section(self) -> dict[str, str]:
        """The run summary's `executor` section."""
        return {"name": self.name, "reason": self.reason}


def visible_gpus(env: dict[str, str] | None = None, dev: str = "/dev") -> int:
    """NVIDIA GPUs this process can use: $CUDA_VISIBLE_DEVICES entries when set (empty or starting with
    -1: none), else the /dev/nvidiaN device nodes."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid index; -1 is the usual way to hide every device
        return 0 if not entries or entries[0].startswith("-") else len(entries)
    try:
        return sum(1 for name in os.listdir(dev) if _DEVICE_NODE.fullmatch(name))
    except OSError:
        return 0


def _named_cluster(address: str | None) -> str | None:
    """Why a run would attach to an existing Ray cluster, None when it would not."""
    import sys

    if address:
        return f"--address {address}"
    if os.environ.get("RAY_ADDRESS"):
        return "RAY_ADDRESS is set"
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return "this process is already connected to Ray"
    return None


def local_engine_count(spec: Any, gpus: int, cpus: float | None = None) -> int:
    """The engines a Ray run of `spec` would start on this machine alone (ray_data.engine_count)."""
    from deepinfer.pipeline.executors.ray_data import RaySession, engine_count

    cpus = float(cpus if cpus is not None else (os.cpu_count() or 1))
    session = RaySession(owned=True, num_gpus=gpus, num_cpus=cpus, node_cpus=(cpus,))
    device = spec.model.device
    use_gpu = gpus > 0 and device != "cpu"
    return engine_count(spec.runtime.engines, session, use_gpu, spec.model.tensor_parallel_size)


def choose_executor(spec: Any, address: str | None, gpus: int | None = None) -> ExecutorChoice:
    """The executor of `spec` (a JobSpec) for a submit with `--address` `address` (module docstring);
    `gpus` replaces the count of this machine's GPUs (tests)."""
    requested = spec.runtime.executor
    if requested != "auto":
        return ExecutorChoice(requested, f"runtime.executor: {requested}")
    cluster = _named_cluster(address)
    if cluster is not None:
        return ExecutorChoice("ray", f"auto: a Ray cluster is named ({cluster})")
    gpus = visible_gpus() if gpus is None else gpus
    engines = local_engine_count(spec, gpus)
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus and spec.model.device != "cpu" else "CPU"
    if engines == 1:
        return ExecutorChoice("local", f"auto: one engine ({where}), no Ray address")
    return ExecutorChoice("ray", f"auto: {engines} engines ({where}) on this machine")


def with_executor(spec: Any, choice: ExecutorChoice) -> Any:
    """`spec` with runtime.executor set to the chosen executor (its document, what _job.json records,
    keeps what the user wrote: the executor is not part of the job's identity)."""
    from dataclasses import replace

    if spec.runtime.executor == choice.name:
        return spec
    return replace(spec, runtime=replace(spec.runtime, executor=choice.name))


def sweep_with_executor(spec: Any, choice: ExecutorChoice) -> Any:
    """A sweep's `spec` with the chosen executor in its document too: each point's spec is rebuilt from
    the document (sweep.point_specs), so the points run where the sweep's one decision says."""
    import copy
    from dataclasses import replace

    if spec.document["runtime"].get("executor") == choice.name:
        return with_executor(spec, choice)
    document = copy.deepcopy(spec.document)
    document["runtime"]["executor"] = choice.name
    return replace(with_executor(spec, choice), document=document)
