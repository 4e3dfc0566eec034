"""Where a DeepSeek-V4 run's time goes: device time per model part, for the eager (non-graph) steps.

`PhaseTimer(model)` shadows the forward / methods of the parts below on their instances (restored on exit)
with CUDA events around each call (perf_counter on CPU), so it needs no hooks in the engine. V4 runs every
step eagerly (engine/runner/cuda_graphs.py captures plain decoder models only), so prefill and decode are
both covered; a step replayed from a CUDA graph would run no Python and not be seen. Parts nest (attention
includes the compressor, the indexer and the sink attention): each is reported on its own, not as a share
of its parent.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

# (label, class name of the instances to wrap, attribute): model parts in the order of a layer.
PARTS = (
    ("model forward", "DeepseekV4ForCausalLM", "forward"),
    ("hyper-connections", "HyperConnection", "forward"),
    ("attention (all)", "V4Attention", "forward"),
    ("compressor writes", "V4Attention", "_write_compressed"),
    ("indexer select (incl. top-k)", "LightningIndexer", "select"),
    ("MoE", "V4MoE", "forward"),
)
# The ops the attention calls per piece (one shared ops object).
OPS = (("sink attention op", "v4_sink_attention"), ("indexer scores op", "v4_indexer_scores"))


class PhaseTimer:
    """Context manager: while inside, every call of the wrapped parts is timed; `summary()` after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cuda = next(model.parameters()).is_cuda
        self.events: dict[str, list[Any]] = defaultdict(list)
        self._restore: list[tuple[Any, str]] = []

    def _wrap(self, obj: Any, attr: str, label: str) -> None:
        inner = getattr(obj, attr)
        events = self.events[label]
        cuda = self.cuda

        def timed(*args: Any, **kwargs: Any) -> Any:
            if cuda and torch.cuda.is_current_stream_capturing():  # a graph capture: nothing to time
                return inner(*args, **kwargs)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = inner(*args, **kwargs)
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                out = inner(*args, **kwargs)
                events.append(time.perf_counter() - t0)
            return out

        setattr(obj, attr, timed)
        self._restore.append((obj, attr))

    def __enter__(self) -> PhaseTimer:
        ops = None
        for label, cls, attr in PARTS:
            for m in self.model.modules():
                if type(m).__name__ == cls:
                    self._wrap(m, attr, label)
                    ops = ops or getattr(m, "ops", None)
        if ops is not None:
            for label, attr in OPS:
                if hasattr(ops, attr):
                    self._wrap(ops, attr, label)
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, attr in reversed(self._restore):
            delattr(obj, attr)  # the instance attribute goes; the class's method shows again
        self._restore.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per part: calls and total milliseconds (device time between the events on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for label, evs in self.events.items():
            if not evs:
                continue
            ms = sum(s.elapsed_time(e) for s, e in evs) if self.cuda else 1000 * sum(evs)
            out[label] = {"calls": len(evs), "ms": round(ms, 2)}
        return out
