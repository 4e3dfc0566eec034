"""The cyclic collector is kept quiet during an engine run (core/gc_scope.py): objects that exist when the run
starts are frozen for the run and handed back after it, the young generation's threshold is raised for the
run and restored, garbage made during the run is still collected, garbage from before is collected once
the run ends, and a freeze made by someone else (or a disabled collector) is left alone."""

from __future__ import annotations

import gc
import weakref

import pytest
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.gc_scope import RUN_GEN0_THRESHOLD, quiet_gc


class Node:
    def __init__(self) -> None:
        self.me = self   # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def no_freeze():
    gc.unfreeze()   # tests start from an unfrozen heap
    yield
    gc.unfreeze()


def test_objects_from_before_are_frozen_for_the_block_and_collectable_after():
    old = Node()
    ref = weakref.ref(old)
    del old
    threshold = gc.get_threshold()
    with quiet_gc():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] >= RUN_GEN0_THRESHOLD
        gc.collect()
        assert ref() is not None   # frozen: not scanned during the block
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    gc.collect()
    assert ref() is None           # handed back: collected after the block


def test_garbage_made_inside_the_block_is_collected_inside_it():
    with quiet_gc():
        ref = weakref.ref(Node())
        gc.collect()
        assert ref() is None


@pytest.mark.parametrize("case", ["frozen_by_someone_else", "collector_disabled", "switched_off"])
def test_leaves_the_collector_as_it_found_it(case, monkeypatch):
    if case == "frozen_by_someone_else":
        gc.freeze()
    elif case == "collector_disabled":
        gc.disable()
    else:
        monkeypatch.setenv("DEEPINFER_DISABLE_QUIET_GC", "1")
    try:
        before = gc.get_freeze_count(), gc.get_threshold()
        with quiet_gc():
            assert (gc.get_freeze_count(), gc.get_threshold()) == before
        assert (gc.get_freeze_count(), gc.get_threshold()) == before
    finally:
        gc.enable()


def test_exception_in_the_block_still_unfreezes():
    threshold = gc.get_threshold()
    with pytest.raises(RuntimeError), quiet_gc():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_runs_with_the_heap_frozen(model_dir, overlap):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, async_scheduling=overlap)
    seen: list[int] = []
    update = llm.engine.scheduler.update

    def recording(*a, **k):
        seen.append(gc.get_freeze_count())
        return update(*a, **k)

    llm.engine.scheduler.update = recording
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0


def test_requests_are_built_with_the_heap_frozen_too(model_dir):
    """generate's request building (seeds, sequences) allocates as much as a run's first steps: it runs
    inside the same quiet scope, and the engine's own scope nests inside it without unfreezing early."""
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    seen: list[int] = []
    make = llm._make_seqs

    def recording(*a, **k):
        seen.append(gc.get_freeze_count())
        return make(*a, **k)

    llm._make_seqs = recording
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(seen) == 2 and min(seen) > 0
    assert gc.get_freeze_count() == 0


def test_a_nested_scope_never_walks_the_frozen_heap(monkeypatch):
    """gc.get_freeze_count() walks the permanent generation (the whole heap inside a scope): the engine's
    scope nested in generate's must not call it, and must leave the outer scope's freeze in place."""
    with quiet_gc():
        frozen = gc.get_freeze_count()

        def walk() -> int:
            raise AssertionError("a nested quiet_gc asked for the freeze count")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        with quiet_gc():
            pass
        monkeypatch.undo()
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
