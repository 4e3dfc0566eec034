"""Where a run's fixed cost goes: the run summary's `startup` figures (schemas/summary.schema.json).

The driver marks its phases, the engines report their start-up marks and per-part figures with their rows
(stages/generate.py); :class:`StartupClock` turns them into seconds since the run started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def process_started_epoch() -> float | None:
    """When this process started (epoch seconds; Linux /proc), None where that cannot be read: what the
    summary's startup figures count interpreter start and imports from."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        import os

        ticks = float(stat[stat.rfind(")") + 2:].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# The engine actors' start-up marks (epochs, generate.EngineStage.marks) the summary reports, earliest
# engine first: summary key -> mark name.
ENGINE_MARKS = (("engine_process_started_s", "process"), ("engine_actor_started_s", "init"),
                ("engine_imported_s", "imported"), ("engine_allocated_s", "allocated"),
                ("engine_weights_loaded_s", "weights_loaded"), ("engine_kv_allocated_s", "kv_allocated"),
                ("model_loaded_s", "built"), ("engine_ready_s", "ready"))


@dataclass
class StartupClock:
    """Where a run's fixed cost goes (the summary's `startup`): driver phase marks (time.time() epochs)
    and what the engines report on their parts (`__spec` "timing", stages/generate.py): start-up marks
    once per engine, then per part the time the engine waited for it, generated and committed it."""

    driver: dict[str, float] = field(default_factory=dict)
    # the local executor's engine preload (executors/engine_preload.py): its thread fills these epochs
    preload: dict[str, float] = field(default_factory=dict)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    capture_s: dict[str, float] = field(default_factory=dict)
    first_received: float | None = None
    wait_s: float = 0.0
    generate_s: float = 0.0
    commit_s: float = 0.0

    def mark(self, name: str) -> None:
        """Record driver phase `name` now (the first time only)."""
        self.driver.setdefault(name, time.time())

    def add(self, timing: dict[str, Any]) -> None:
        """Count one part's figures from an engine (generate.EngineStage.part_timing)."""
        engine = str(timing.get("engine"))
        if "startup" in timing:
            self.engines[engine] = {k: float(v) for k, v in timing["startup"].items() if v is not None}
            if timing.get("cuda_graph_capture_s") is not None:
                self.capture_s[engine] = float(timing["cuda_graph_capture_s"])
        else:  # the first part's wait is start-up (engine ready -> first part), reported as a mark
            self.wait_s += float(timing["wait_s"])
        received = float(timing["received"])
        self.first_received = received if self.first_received is None else min(self.first_received, received)
        self.generate_s += float(timing["generate_s"])
        self.commit_s += float(timing["commit_s"])

    def section(self, start_epoch: float, first_token: float | None, first_commit: float | None,
                wall: float) -> dict[str, float | None]:
        def since(epoch: float | None) -> float | None:
            return None if epoch is None else round(epoch - start_epoch, 3)

        def earliest(name: str) -> float | None:
            found = [m[name] for m in self.engines.values() if name in m]
            return min(found) if found else None

        started = process_started_epoch()
        out: dict[str, float | None] = {"driver_process_started_s": since(started)}
        for key in ("model_checked", "output_opened", "executor_requested", "executor_started",
                    "first_result", "last_result", "results_closed"):
            out[f"{key}_s"] = since(self.driver.get(key))
        for name in ("started", "native", "cuda", "triton"):
            out[f"engine_preload_{name}_s"] = since(self.preload.get(name))
        for key, name in ENGINE_MARKS:
            out[key] = since(earliest(name))
        ready = [m["ready"] for m in self.engines.values() if "ready" in m]
        out["last_engine_ready_s"] = since(max(ready)) if ready else None
        out["first_part_received_s"] = since(self.first_received)
        out["first_token_s"] = since(first_token)
        out["first_commit_s"] = None if first_commit is None else round(first_commit, 3)
        out["wall_s"] = round(wall, 3)
        out["cuda_graph_capture_s"] = round(max(self.capture_s.values()), 3) if self.capture_s else None
        out["engine_wait_s"] = round(self.wait_s, 3)
        out["engine_generate_s"] = round(self.generate_s, 3)
        out["engine_commit_s"] = round(self.commit_s, 3)
        return out
