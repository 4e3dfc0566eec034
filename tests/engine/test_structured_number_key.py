"""Number classes of the grammar-state key (structured/number_key.py) against fresh llguidance masks:
every prefix up to a bounded length of several number schemas (one byte per token, so every split is
met), grouped by key, has one mask per group; a deliberately wrong class is shown to be caught; and what
the plan reads as a number class (the rest stays verbatim)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.structured import number_key
from deepinfer.engine.structured.backend import GrammarSpec
from deepinfer.engine.structured.normalize import prepare_json_schema
from deepinfer.engine.structured.state_key import NumberNode, ObjectNode, StateKey, plan_of

from tests.support.structured_demo import demo_manager

NUMBERS = {
    "unbounded_number": ({"type": "number"}, "number"),
    "unbounded_integer": ({"type": "integer"}, "integer"),
    "unit_range": ({"type": "number", "minimum": 0, "maximum": 1}, "range"),
    "range_3_17": ({"type": "number", "minimum": 3, "maximum": 17.0}, "range"),
    "minimum_only": ({"type": "number", "minimum": 5}, "range"),
}
ALPHABET = b"0135.-eE+"  # zero, a nonzero digit, bounds' digits, and every non-digit a number may hold
DEPTH = 5


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    with demo_manager(tmp_path_factory.mktemp("number_key_tok"), 8, max_threads=1, steering=False,
                      mask_cache_size=16) as m:
        yield m


def _schema(num: dict) -> dict:
    return {"type": "object", "properties": {"x": num, "y": {"type": "string", "maxLength": 2}},
            "required": ["x", "y"], "additionalProperties": False}


def _mismatches(manager, name: str) -> tuple[list, int]:
    """Walk every byte string over ALPHABET (up to DEPTH) the grammar accepts after `{"x": `, one
    single-byte token per byte, then the terminator `,`; returns the prefixes whose key was met before
    with another mask, and how many prefixes shared a key with an earlier, different one."""
    spec = GrammarSpec.of("json_schema", _schema(NUMBERS[name][0]))
    grammar = manager.compile(spec)
    be = manager.backend
    byte_tok = {b[0]: t for t, b in enumerate(manager._token_bytes) if b is not None and len(b) == 1}
    row = torch.zeros(1, be.words, dtype=torch.int32)

    def allowed(m, tok: int) -> bool:
        be.fill_bitmasks([(0, m)], row)
        return bool((row[0, tok // 32].item() >> (tok % 32)) & 1)

    root = be.new_matcher(grammar)
    for b in b'{"x": ':
        assert root.accept_token(byte_tok[b])
    seen: dict[tuple, tuple[torch.Tensor, bytes]] = {}
    bad, shared = [], 0
    frontier = [(root, b"")]
    for _ in range(DEPTH + 1):
        nxt = []
        for m, text in frontier:
            for b in ALPHABET + (b"," if text else b""):
                if not allowed(m, byte_tok[b]):
                    continue
                child = m.raw.deep_copy()
                assert child.consume_token(byte_tok[b])
                key = StateKey(grammar.state_plan, spec.key)
                key.feed(b'{"x": ' + text + bytes((b,)))
                k = key.key
                assert k is not None, (name, text + bytes((b,)))
                be.fill_bitmasks([(0, type(m)(child, be.words))], row)
                if k in seen:
                    first, first_text = seen[k]
                    if not torch.equal(first, row[0]):
                        bad.append((first_text, text + bytes((b,))))
                    shared += first_text != text + bytes((b,))
                else:
                    seen[k] = (row[0].clone(), text + bytes((b,)))
                if b != ord(","):
                    nxt.append((type(m)(child, be.words), text + bytes((b,))))
        frontier = nxt
    return bad, shared


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_every_short_prefix_of_a_class_has_its_mask(manager, name):
    bad, shared = _mismatches(manager, name)
    assert not bad, (name, bad[:5])
    assert shared >= 20, (name, shared)  # prefixes must really meet, else this tests nothing


def test_a_wrong_class_is_caught(manager, monkeypatch):
    """Dropping a range number's integer digits would give `0.` (any fraction) and `1.` (zeros only)
    one key: the same check must find masks that differ."""
    right = number_key._range_step

    def wrong(state, b, long_after=None):
        out = right(None if state is None else (state[0], b"0"), b, long_after)
        return None if out is None else (out[0], b"?")

    monkeypatch.setattr(number_key, "_range_step", wrong)
    bad, _ = _mismatches(manager, "unit_range")
    assert bad


def test_plan_reads_only_plain_numbers_and_non_negative_integer_ranges():
    def node(num):
        plan = plan_of(prepare_json_schema(_schema(num)))
        assert isinstance(plan, ObjectNode)
        return plan.props[b"x"]

    for num, kind in NUMBERS.values():
        assert isinstance(node(num), NumberNode) and node(num).kind == kind
    for verbatim in ({"type": "number", "minimum": 0.5, "maximum": 1},        # fractional bound
                     {"type": "number", "minimum": -1, "maximum": 1},         # negative bound
                     {"type": "number", "maximum": 1},                       # negatives allowed
                     {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                     {"type": "number", "multipleOf": 2},
                     {"type": "integer", "minimum": 0, "maximum": 9},         # its digits are the state
                     {"type": "number", "minimum": 1, "maximum": 1}):
        assert node(verbatim) is None, verbatim
    assert number_key.number_node({"type": "number", "minimum": True}) is None  # a bool is no bound
    with pytest.raises(ValueError, match="kind"):
        NumberNode("float")
