"""Shared helpers of the safe_yaml tests (tests/pipeline/test_safe_yaml*.py): the module under test loaded
by file path, time limits, and the hostile documents more than one test file uses."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import yaml

_REPO = Path(__file__).resolve().parents[2]


def _load_module() -> ModuleType:
    # Loaded by file path: the pipeline.spec package (its __init__) may not exist yet, and the module is
    # meant to stand alone (stdlib + PyYAML only).
    path = _REPO / "pipeline" / "spec" / "safe_yaml.py"
    spec = importlib.util.spec_from_file_location("_safe_yaml_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


safe_yaml = _load_module()
SpecSyntaxError = safe_yaml.SpecSyntaxError
load_spec_text = safe_yaml.load_spec_text
parse_override = safe_yaml.parse_override

# The limits hold for libyaml's C parser, which safe_yaml uses whenever PyYAML has it; PyYAML's pure-Python
# parser (its fallback) is ~5x slower on the largest documents the limits admit, so it gets 5x the time.
_SLOWDOWN = 1.0 if safe_yaml._Loader is getattr(yaml, "CSafeLoader", None) else 5.0
# The bounds say "cut at once", not how fast: the heaviest admitted input costs ~0.4 s CPU alone, and an
# uncut billion-laughs document would run for hours, so 3x headroom keeps a busy 2-core CI machine green
# (1.18 s CPU was seen there) while any lost limit still fails.
TIME_LIMIT_S = 5.0 * _SLOWDOWN
CPU_LIMIT_S = 3.0 * _SLOWDOWN
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Timer:
    """Wall and CPU time of a block: wall under 2 s each, and CPU under 1 s (the design target is well
    under that; the CPU bound does not depend on how busy the test machine is)."""

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def check(self) -> None:
        assert self.wall < TIME_LIMIT_S, f"took {self.wall:.2f}s wall"
        assert self.cpu < CPU_LIMIT_S, f"took {self.cpu:.2f}s CPU"


def _refused(data: bytes | str, **limits: int) -> SpecSyntaxError:
    """load_spec_text(data) must raise SpecSyntaxError, quickly, with a one-line bounded message."""
    with _Timer() as timer, pytest.raises(SpecSyntaxError) as info:
        load_spec_text(data, "spec.yaml", **limits)
    timer.check()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    # A message quotes at most ~60 characters of any bad value, so it stays short whatever the input.
    assert len(message) < 400, message
    return info.value


def _bomb(levels: int, fanout: int, style: str) -> str:
    """An alias bomb of `levels` anchored levels, each referring `fanout` times to the one before."""
    if style == "list":
        lines = [f"l0: &l0 [{', '.join(['lol'] * fanout)}]"]
        lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    elif style == "dict":
        lines = ["l0: &l0 {" + ", ".join(f"k{j}: lol" for j in range(fanout)) + "}"]
        lines += [f"l{i}: &l{i} {{" + ", ".join(f"k{j}: *l{i - 1}" for j in range(fanout)) + "}"
                  for i in range(1, levels)]
    elif style == "block":
        lines = ["l0: &l0"] + ["  - lol"] * fanout
        for i in range(1, levels):
            lines += [f"l{i}: &l{i}"] + [f"  - *l{i - 1}"] * fanout
    else:  # merge keys: every level merges the previous one several times over
        lines = ["l0: &l0 {" + ", ".join(f"k{j}: lol" for j in range(fanout)) + "}"]
        lines += [f"l{i}: &l{i} {{<<: [{', '.join([f'*l{i - 1}'] * fanout)}], own{i}: x}}"
                  for i in range(1, levels)]
    return "\n".join(lines) + "\n"


BILLION_LAUGHS = _bomb(9, 9, "list")
