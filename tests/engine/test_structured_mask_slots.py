"""Masks filled ahead of the step (structured/mask_slots.py): a request's next mask is queued when its grammar
advances, sampling applies it from the request's slot, and the result equals a mask filled at sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer.engine import SamplingParams
from deepinfer.kernels.reference.token_mask import unpack_bitmask

from tests.support.structured_demo import demo_manager

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    with demo_manager(tmp_path_factory.mktemp("slots_tok"), 40, max_threads=2) as m:
        yield m


def _seq(manager, params, out_len=0):
    s = SimpleNamespace(params=params, grammar=None, num_output_tokens=out_len, num_tokens=5 + out_len)
    manager.add(s)
    return s


def _fresh_mask(manager, state) -> torch.Tensor:
    bm = manager.allocate_bitmask(1)
    manager.backend.fill_bitmasks([(0, state.matcher)], bm)
    return unpack_bitmask(bm, manager.vocab_size)[0]


def _sample(manager, seqs, gen):
    """One step: mask random logits of `seqs`, take the argmax of each, advance (the engine's order)."""
    job = manager.masks_for(seqs)
    logits = torch.randn(len(seqs), manager.vocab_size, generator=gen)
    job.wait()   # a matcher must not be used while its queued fill runs
    expected = [_fresh_mask(manager, s.grammar) for s in seqs]   # from the state, filled now
    job.apply(logits)
    for row, allowed in enumerate(expected):
        assert torch.equal(torch.isfinite(logits[row]), allowed)
    done = []
    for s, t in zip(seqs, logits.argmax(-1).tolist()):
        s.num_output_tokens += 1
        s.num_tokens += 1
        done.append(manager.advance(s, t))
    return done


def test_advance_queues_the_next_mask_and_sampling_uses_it(manager):
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq(manager, SamplingParams(json_schema=SCHEMA, max_tokens=64)) for _ in range(5)]
    # The first mask (the initial state's) is queued when the request is added, before its prefill ends.
    assert len({s.grammar.slot for s in seqs}) == 5 and all(s.grammar.fill is not None for s in seqs)
    before = manager.mask_stats()
    for _ in range(6):
        done = _sample(manager, seqs, gen)
        live = [s for s, d in zip(seqs, done) if not d]
        assert all(s.grammar.fill is not None for s in live)   # queued by advance, before masks_for
        seqs = live
    after = manager.mask_stats()
    assert after["mask_steps"] == before["mask_steps"] + 6
    assert after["fill_seconds"] > before["fill_seconds"] and 0.0 <= after["overlapped_fraction"] <= 1.0
    for s in seqs:
        manager.free(s)


@pytest.fixture
def fresh_manager(tmp_path):
    """A manager of its own: fills left running by another test give their slots back whenever they finish
    (release's callback), which could put another slot on top of the free list mid-test."""
    with demo_manager(tmp_path, 40, max_threads=2) as m:
        yield m


def test_no_fill_is_queued_past_the_budget_and_slots_are_reused(fresh_manager):
    manager = fresh_manager
    s = _seq(manager, SamplingParams(json_schema=SCHEMA, max_tokens=1))
    slot = s.grammar.slot
    _sample(manager, [s], torch.Generator().manual_seed(1))
    assert s.grammar.fill is None          # max_tokens reached: never sampled again, nothing queued
    manager.free(s)
    assert s.grammar is None
    again = _seq(manager, SamplingParams(choice=["yes", "no"]))
    assert again.grammar.slot == slot
    manager.free(again)


def test_buffer_growth_keeps_filled_rows(manager):
    gen = torch.Generator().manual_seed(2)
    seqs = [_seq(manager, SamplingParams(choice=["alpha", "beta", "gamma"])) for _ in range(70)]
    assert manager.slots.buffer.shape[0] >= 70
    assert len({s.grammar.slot for s in seqs}) == 70
    _sample(manager, seqs, gen)
    for s in seqs:
        manager.free(s)


def test_steering_twice_from_one_state_gives_one_mask(manager):
    # Masked twice without a token in between (not the engine's order, but allowed): same steered mask.
    s = _seq(manager, SamplingParams(json_schema={"type": "string"}, max_tokens=40), out_len=31)
    assert all(manager.accept(s.grammar, t) for t in manager.backend.tokenizer.tokenize_str('"abc'))
    first = manager.masks_for([s]).bitmask
    second = manager.masks_for([s]).bitmask
    assert torch.equal(first, second)
    assert unpack_bitmask(first, manager.vocab_size)[0].sum() < _fresh_mask(manager, s.grammar).sum()
    manager.free(s)
