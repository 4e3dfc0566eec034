"""The fill path of structured/mask_slots.py: stored masks copied when the fill is queued (`inline_hits`)
are the fresh fills, need no worker, wait for the device to finish reading the buffer, and pick the same
tokens as the worker path; and how many fill threads the backend takes by default."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from deepinfer.engine import SamplingParams
from deepinfer.engine.structured import llguidance_backend

from tests.support.structured_demo import allowed_tokens, checked_walk, demo_manager

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "topics": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["label", "confidence", "topics"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    with demo_manager(tmp_path_factory.mktemp("fill_path_tok"), 24, max_threads=1, steering=False,
                      mask_cache_size=256) as m:
        yield m


def _walk(manager, seed: int, rows: int = 8, steps: int = 30) -> list[list[int]]:
    """Rows through the engine's order (prefetch on), every slot checked against a fresh fill."""
    return checked_walk(manager, SamplingParams(max_tokens=steps, json_schema=SCHEMA), rows, steps, seed)


def test_hits_copied_at_submit_are_fresh_fills_and_pick_the_same_tokens(manager):
    slots = manager.slots
    manager.mask_cache.clear()
    off_before = slots.inline_rows
    slots.inline_hits = False
    try:
        off = _walk(manager, seed=3)
    finally:
        slots.inline_hits = True
    assert slots.inline_rows == off_before
    manager.mask_cache.clear()
    before, batches = slots.inline_rows, slots.fill_batches
    on = _walk(manager, seed=3)
    assert on == off
    copied, worker_batches = slots.inline_rows - before, slots.fill_batches - batches
    assert copied >= 40, copied               # number classes and free strings: most rows are hits
    assert worker_batches < sum(map(len, on)), worker_batches  # and those never reach the worker


class _DeviceStillReading:
    """Stands in for the CUDA event of the last host->device copy of the slot buffer on this CPU-only
    machine: a copy that has not finished (query False) until the worker waits for it."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_no_copy_at_submit_while_the_device_may_read_the_buffer(manager):
    params = SamplingParams(max_tokens=8, json_schema=SCHEMA)
    first = SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
    manager.add(first)  # the initial state's mask: computed, then kept once a second row needs it
    second = SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
    manager.add(second)
    manager.slots.wait_idle()
    event = _DeviceStillReading()
    manager.slots.copied(event)
    try:
        third = SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
        before = manager.slots.inline_rows
        manager.add(third)
        third.grammar.fill.result()
        assert manager.slots.inline_rows == before and event.waited  # queued: the worker waited for it
        fourth = SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
        manager.add(fourth)                                           # the copy is known done now
        assert manager.slots.inline_rows == before + 1 and fourth.grammar.fill.done()
        buf = manager.slots.buffer
        assert torch.equal(buf[fourth.grammar.slot], buf[third.grammar.slot])
    finally:
        manager.slots.copied(None)
        for s in (first, second, third, fourth):
            manager.free(s)


def test_default_threads_are_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(llguidance_backend.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert llguidance_backend.default_threads() == 6
    monkeypatch.setattr(llguidance_backend.os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert llguidance_backend.default_threads() == 16
    monkeypatch.delattr(llguidance_backend.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(llguidance_backend.os, "cpu_count", lambda: None)
    assert llguidance_backend.default_threads() == 1


@pytest.mark.gpu
def test_copies_at_submit_with_the_masks_applied_on_cuda(manager):
    """The engine's order with real device copies of the slot buffer (CUDA events): each step's masked
    logits are the fresh fills, and rows are copied at submit once the copy that read them is done."""
    rng = random.Random(7)
    params = SamplingParams(max_tokens=24, json_schema=SCHEMA)
    seqs = [SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5) for _ in range(6)]
    for s in seqs:
        manager.add(s)
    before = manager.slots.inline_rows
    fresh = manager.allocate_bitmask(1)
    for _ in range(24):
        alive = [s for s in seqs if s.grammar is not None]
        if not alive:
            break
        job = manager.masks_for(alive)
        logits = torch.zeros(len(alive), manager.vocab_size, device="cuda")
        job.apply(logits)
        finite = torch.isfinite(logits).cpu()
        for row, s in enumerate(alive):
            manager.backend.fill_bitmasks([(0, s.grammar.matcher)], fresh)
            allowed = allowed_tokens(fresh[0], manager.vocab_size)
            assert finite[row].nonzero().flatten().tolist() == allowed
            s.num_output_tokens += 1
            s.num_tokens += 1
            if manager.advance(s, rng.choice(allowed)) or s.num_output_tokens >= 24:
                manager.free(s)
    for s in seqs:
        manager.free(s)
    assert manager.slots.inline_rows > before
