"""Penalty token tables (engine/sample/penalty_tokens.py) and the sparse penalties built from them.

A table grown step by step is the table built at once from the final lists; its entries applied to logits
give the bits of the dense rule over a [rows, V] table (the specification, written out below)."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.penalties import apply_penalties
from deepinfer.engine.sample.penalty_tokens import PenaltyTokens, pack_entries, sequence_entries

V = 50


def _table(t: PenaltyTokens) -> list[tuple[int, int]]:
    return [tuple(e) for e in t.entries.T.tolist()]


def test_entries_list_prompt_ids_ascending_then_new_output_ids_by_first_appearance():
    t = PenaltyTokens([9, 3, 9, 7], V).sync([7, 20, 3, 20, 11, 20])
    assert _table(t) == [(3, 1), (7, 1), (9, 0), (20, 3), (11, 1)]


@pytest.mark.parametrize("prompt,outputs,want", [
    ([], [], []),
    ([-3, V, V + 7, 4], [-2, 4, V], [(4, 1)]),           # ids outside [0, V) are dropped
    ([1, 2], [PENDING_TOKEN], [(1, 0), (2, 0)]),        # the overlapped loop's placeholder is not counted
    ([5], [5, 5, 5], [(5, 3)]),
])
def test_tables_of_edge_cases(prompt, outputs, want):
    assert _table(PenaltyTokens(prompt, V).sync(outputs)) == want


@pytest.mark.parametrize("seed", range(6))
def test_a_table_grown_step_by_step_equals_one_built_at_once(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(-2, V + 2) for _ in range(rng.randrange(0, 40))]
    outputs: list[int] = []
    grown = PenaltyTokens(prompt, V)
    for _ in range(rng.randrange(1, 120)):   # past the initial capacity: the arrays grow
        outputs.extend(rng.randrange(V + 3) for _ in range(rng.choice([1, 1, 1, 3])))
        if rng.random() < 0.2:   # a placeholder appended, then resolved to its id (overlapped loop)
            outputs.append(PENDING_TOKEN)
            grown.sync(outputs)
            outputs[-1] = rng.randrange(V)
        grown.sync(outputs)
        assert _table(grown) == _table(PenaltyTokens(prompt, V).sync(outputs))


def test_fewer_outputs_than_taken_restarts_from_the_prompt():
    t = PenaltyTokens([4, 2], V).sync([2, 8, 9, 8])
    assert _table(t.sync([2, 8])) == [(2, 1), (4, 0), (8, 1)]
    assert _table(t.sync([2, 8, 4])) == [(2, 1), (4, 1), (8, 1)]


def test_a_sequence_keeps_its_table_and_syncs_only_new_outputs():
    seq = Sequence(seq_id=0, prompt_token_ids=[3, 1], params=SP(repetition_penalty=1.2), seed=0)
    sequence_entries(seq, V)
    first = seq.penalty_tokens
    seq.output_token_ids += [1, 6]
    assert sequence_entries(seq, V).T.tolist() == [[1, 1], [3, 0], [6, 1]] and seq.penalty_tokens is first
    assert sequence_entries(seq, 4).T.tolist() == [[1, 1], [3, 0]] and seq.penalty_tokens is not first


@pytest.mark.parametrize("extra", [[], [6], [3, 9, 9, V, 6], [PENDING_TOKEN + 0, 2]])
def test_entries_with_drafts_are_those_of_the_drafts_committed_and_leave_the_table(extra):
    seq = Sequence(seq_id=0, prompt_token_ids=[3, 1, 7], params=SP(repetition_penalty=1.5), seed=0,
                   output_token_ids=[7, 6, 6])
    before = sequence_entries(seq, V).copy()
    got = sequence_entries(seq, V, extra)
    valid = [t for t in extra if 0 <= t < V]
    assert got.T.tolist() == [list(e) for e in _table(PenaltyTokens([3, 1, 7], V).sync([7, 6, 6, *valid]))]
    assert (sequence_entries(seq, V) == before).all()


@pytest.mark.parametrize("params,want", [
    (SP(repetition_penalty=1.2), [[1, 0], [3, 0], [7, 1], [6, 2]]),
    (SP(presence_penalty=0.5, frequency_penalty=0.1), [[7, 1], [6, 2]]),   # output counts only
])
def test_prompt_entries_only_under_a_repetition_penalty(params, want):
    seq = Sequence(seq_id=0, prompt_token_ids=[3, 1, 7], params=params, seed=0, output_token_ids=[7, 6, 6])
    assert sequence_entries(seq, V).T.tolist() == want


def test_pack_entries_lists_rows_in_order():
    a, b, c = (PenaltyTokens(p, V).sync(o).entries for p, o in (([2], [2, 5]), ([], []), ([7], [])))
    assert pack_entries([a, b, c]).tolist() == [[0, 0, 2], [2, 5, 7], [1, 1, 0]]
    assert tuple(pack_entries([]).shape) == (3, 0)


def _dense(logits: torch.Tensor, params: list[SP], prompts, outputs) -> torch.Tensor:
    """The specification: every token of a penalised row, seen-table and counts over the whole vocabulary."""
    out = logits.clone()
    for i, p in enumerate(params):
        seen = torch.zeros(V, dtype=torch.bool)
        counts = torch.zeros(V, dtype=torch.float32)
        for t in prompts[i]:
            if 0 <= t < V:
                seen[t] = True
        for t in outputs[i]:
            if 0 <= t < V:
                seen[t] = True
                counts[t] += 1
        x = out[i]
        r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        f, pr = (torch.tensor(v, dtype=torch.float32) for v in (p.frequency_penalty, p.presence_penalty))
        out[i] = x - (f * counts + pr * (counts > 0).to(torch.float32))
    return out


PENALISED = [SP(repetition_penalty=1.3), SP(repetition_penalty=0.7), SP(presence_penalty=0.5),
             SP(frequency_penalty=-0.37), SP(),
             SP(repetition_penalty=1.9, presence_penalty=-1.1, frequency_penalty=0.3)]


@pytest.mark.parametrize("seed", range(4))
def test_sparse_penalties_give_the_dense_rule_bit_for_bit(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = 16
    params = [rng.choice(PENALISED) for _ in range(n)]
    prompts = [[rng.randrange(-1, V + 1) for _ in range(rng.randrange(0, 30))] for _ in range(n)]
    outputs = [[rng.randrange(V + 1) for _ in range(rng.randrange(0, 30))] for _ in range(n)]
    logits = torch.randn(n, V, generator=gen) * 7
    logits[torch.rand(n, V, generator=gen) < 0.1] = float("-inf")
    logits[torch.rand(n, V, generator=gen) < 0.1] = 0.0
    meta = SamplingMetadata.from_params(params, [0] * n, [len(o) for o in outputs], V, "cpu",
                                        prompt_token_ids=prompts, output_token_ids=outputs)
    got = logits.clone()
    apply_penalties(got, meta.penalties)
    assert torch.equal(got, _dense(logits, params, prompts, outputs))
