"""Grammar-state keys for JSON Schemas (structured/state_key.py): rows with equal keys have bit-identical
llguidance masks (random walks over many schemas, histories that differ), the tracker's abstraction on
hand-made byte streams, what the plan reads as free strings, and the manager's masks with state keys on are
the fresh fills and pick the same tokens as with them off."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from deepinfer.engine import SamplingParams
from deepinfer.engine.structured.backend import GrammarSpec
from deepinfer.engine.structured.mask_cache import VERBATIM_MARK, MaskCache
from deepinfer.engine.structured.normalize import prepare_json_schema
from deepinfer.engine.structured.state_key import (
    MAX_KEY_BYTES,
    FreeString,
    ObjectNode,
    StateKey,
    char_counts,
    plan_of,
)

from tests.support.spec_catalog import JSON_SCHEMA_CASES
from tests.support.structured_demo import allowed_tokens, checked_walk, demo_manager

_S = {"type": "string"}
SCHEMAS = {
    "bench_like": {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 12}},
        "required": ["label", "confidence", "topics", "summary"], "additionalProperties": False},
    "nested_and_verbatim": {"type": "object", "properties": {
        "who": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 5},
                                                  "tag": {"type": "string", "pattern": "^[a-c]{1,3}$"}},
                "required": ["name", "tag"], "additionalProperties": False},
        "alt": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        "notes": {"type": "array", "items": {"type": "object", "properties": {"t": {**_S, "maxLength": 4}},
                                             "required": ["t"], "additionalProperties": False},
                  "maxItems": 2}},
        "required": ["who", "alt", "notes"], "additionalProperties": False},
    "open_object_unbounded": {"type": "object", "properties": {"a": {**_S, "minLength": 1}, "b": _S},
                              "required": ["a"]},
    "optional_keys": {"type": "object", "properties": {"x": {**_S, "maxLength": 3}, "n": {"type": "integer"},
                                                       "y": {**_S, "maxLength": 4}},
                      "additionalProperties": False},
    "numbers_only": {"type": "object", "properties": {  # number classes alone (number_key.py) make a plan
        "a": {"type": "number"}, "r": {"type": "number", "minimum": 3, "maximum": 17},
        "q": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3}},
        "required": ["a", "r", "q"], "additionalProperties": False},
    **{c.name: c.spec for c in JSON_SCHEMA_CASES if plan_of(prepare_json_schema(c.spec)) is not None},
}


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    with demo_manager(tmp_path_factory.mktemp("state_key_tok"), 40, max_threads=1, steering=False,
                      mask_cache_size=256) as m:
        yield m


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_equal_keys_have_identical_fresh_masks(manager, name):
    """Random walks, half of them preferring single bytes (characters split across tokens, escapes):
    whenever a row's key was met before, its fresh llguidance mask equals the first one bit for bit, and
    keys must meet across different token histories (else this would test nothing)."""
    bad, cross = _walk(manager, name)
    assert not bad, (name, bad[:3])
    assert cross >= 10, (name, cross)


def test_the_walks_catch_a_wrong_number_class(manager, monkeypatch):
    """Taking every open unbounded number's `0` for a nonzero integer (after `0` no digit may follow,
    after `5` any may) is wrong, and the same random walks must find masks that differ."""
    from deepinfer.engine.structured import number_key

    right = number_key.step

    def wrong(node, state, b):
        out = right(node, state, b)
        return number_key.INT if out == number_key.ZERO and node.kind == "number" else out

    monkeypatch.setattr(number_key, "step", wrong)
    bad, _ = _walk(manager, "numbers_only")
    assert bad


def _walk(manager, name: str) -> tuple[list, int]:
    """The random walks of test_equal_keys_have_identical_fresh_masks: the (key, histories) whose fresh
    masks differ although their keys are equal, and how often a key met a different token history."""
    spec = GrammarSpec.of("json_schema", SCHEMAS[name])
    grammar = manager.compile(spec)
    assert grammar.state_plan is not None
    chars = char_counts(manager._token_bytes)
    rng = random.Random(name)
    be, vocab = manager.backend, manager.vocab_size
    single = [t for t, b in enumerate(manager._token_bytes) if b is not None and len(b) == 1]
    row = torch.zeros(1, be.words, dtype=torch.int32)
    seen: dict[tuple, tuple[torch.Tensor, tuple[int, ...]]] = {}
    cross, bad = 0, []
    for walk in range(24):
        m, key, hist = be.new_matcher(grammar), StateKey(grammar.state_plan, spec.key), ()
        for _ in range(48):
            if m.is_terminated() or key.key is None:
                break
            be.fill_bitmasks([(0, m)], row)
            k = key.key
            if k in seen:
                first, first_hist = seen[k]
                if not torch.equal(first, row[0]):
                    bad.append((k, hist, first_hist))
                cross += first_hist != hist
            else:
                seen[k] = (row[0].clone(), hist)
            allowed = allowed_tokens(row[0], vocab)
            pick = [t for t in allowed if t in single] if walk % 2 and rng.random() < 0.7 else []
            tok = int(rng.choice(pick or list(allowed)))
            assert m.accept_token(tok)
            key.feed_token(manager._token_bytes[tok], chars[tok])
            hist += (tok,)
    return bad, cross


def _key(plan, *pieces: bytes) -> tuple | None:
    k = StateKey(plan, "g")
    for p in pieces:
        k.feed(p)
    return k.key


def test_the_abstraction_on_byte_streams():
    plan = plan_of(prepare_json_schema(SCHEMAS["bench_like"]))
    head = b'{"label": "positive", "confidence": 0.25, "topics": ["'
    # Inside a free string only the count matters, however the bytes were split; completed values collapse.
    assert _key(plan, head, b"ab") == _key(plan, head.replace(b"positive", b"negative"), b"x", b"y")
    assert _key(plan, head, b"ab") != _key(plan, head, b"abc")
    assert _key(plan, head, "é".encode()) == _key(plan, head, b"e")                  # one character each
    assert _key(plan, head, "é".encode()[:1]) != _key(plan, head, "ж".encode()[:1])  # pending bytes kept
    assert _key(plan, head, b"a\\n") != _key(plan, head, b"a\\t")                  # from `\` on: verbatim
    assert _key(plan, head, b'ab", "') == _key(plan, head, b'abcdef", "')          # closed: one marker
    # An open number of [0, 1] is its class (number_key.py): the fraction digits collapse, the integer not.
    num = b'{"label": "positive", "confidence": '
    assert _key(plan, num, b"0.2") == _key(plan, num, b"0.", b"3871")
    assert _key(plan, num, b"0.2") != _key(plan, num, b"1.0")
    assert _key(plan, num, b"0.") != _key(plan, num, b"0.2") != _key(plan, num, b"0")
    assert _key(plan, num, b"0.25, ") == _key(plan, num, b"1, ")                        # completed: a marker
    # Outside free strings and numbers bytes are kept until the value completes: an open enum is verbatim,
    # and its key says so (mask_cache keeps such a mask from its second computation only).
    assert _key(plan, b'{"label": "pos') != _key(plan, b'{"label": "neg')
    assert _key(plan, b'{"label": "pos')[-1] == VERBATIM_MARK != _key(plan, head, b"ab")[-1]
    assert _key(plan, head, b"a\\n")[-1] == VERBATIM_MARK != _key(plan, b'{"label": "positive", ')[-1]
    # A key past MAX_KEY_BYTES is not served until a completed value shortens it again.
    long = b'{"label": "' + b"p" * MAX_KEY_BYTES
    assert _key(plan, long) is None and _key(plan, long, b'", "confidence": 1') is not None
    # A byte JSON cannot have there loses the key for good.
    assert _key(plan, b'{"label"x') is None
    assert _key(plan, head, b"a\x01") is None
    # Values inside a container the plan does not read (an anyOf) stay verbatim.
    nested = plan_of(prepare_json_schema(SCHEMAS["nested_and_verbatim"]))
    pre = b'{"who": {"name": "ab", "tag": "a"}, "alt": "'
    assert _key(nested, pre, b"x") != _key(nested, pre, b"y")
    assert _key(nested, pre, b'x", "notes": [') == _key(nested, pre, b'y", "notes": [')


def test_plan_reads_only_plain_strings_on_plain_paths():
    assert plan_of(prepare_json_schema({"type": "string", "pattern": "^a+$"})) is None
    assert plan_of(prepare_json_schema({"anyOf": [{"type": "string"}, {"type": "null"}]})) is None
    assert plan_of({"type": "object", "properties": {"a": _S}, "x-guidance": {"lenient": True}}) is None
    p = plan_of(prepare_json_schema({"type": "object", "properties": {
        "a": {**_S, "maxLength": 3, "title": "t"}, "b": {**_S, "format": "date"}, 'q"k': _S}}))
    assert isinstance(p, ObjectNode) and isinstance(p.props[b"a"], FreeString)
    assert p.props[b"b"] is None and isinstance(p.props[b'q\\"k'], FreeString)
    assert p.props[b"a"].max_len == 3 and p.props[b"a"].min_len == 0


def test_state_masks_kept_from_the_second_computation_in_a_bounded_lru():
    """Verbatim states (key ends in VERBATIM_MARK) are kept from their second computation, abstracted
    ones (they recur by construction) from their first; at most max_masks, least recently used out."""
    cache = MaskCache(words=2, max_masks=2)
    a, b, c = ("g", b"a", VERBATIM_MARK), ("g", b"b", VERBATIM_MARK), ("g", b"c", VERBATIM_MARK)
    cache.store(("g", b"x", 3, b""), np.array([4, 4], dtype=np.int32))
    assert cache.lookup(("g", b"x", 3, b"")).tolist() == [4, 4]   # a free string's count: kept at once
    cache.store(a, np.array([1, 1], dtype=np.int32))
    assert cache.lookup(a) is None                                  # computed once: only remembered
    cache.store(a, np.array([1, 1], dtype=np.int32))
    cache.store(b, np.array([2, 2], dtype=np.int32), shared=True)   # shared in its batch: kept at once
    assert cache.lookup(a).tolist() == [1, 1] and cache.lookup(b).tolist() == [2, 2]
    cache.store(c, np.array([3, 3], dtype=np.int32), shared=True)   # full: the least recently used goes
    assert cache.lookup(a) is None and min(cache.lookup_rows([b, c], [2, 1])) >= 0
    assert cache.stats()["mask_cache_state_masks"] == 2
    cache.clear()
    assert cache.lookup(b) is None and cache.stats()["mask_cache_masks"] == 0


def _engine_walk(manager, seed: int) -> tuple[list[list[int]], int]:
    """Rows through masks_for/advance as the engine drives them; each step every slot must equal a fresh
    fill of its matcher. Returns the tokens picked per row and the rows served by copy."""
    before = manager.mask_stats()
    params = SamplingParams(max_tokens=40, json_schema=SCHEMAS["bench_like"])
    picked = checked_walk(manager, params, rows=10, steps=40, seed=seed)
    after = manager.mask_stats()
    return picked, after["mask_cache_hits"] - before["mask_cache_hits"]


def test_manager_masks_with_state_keys_are_fresh_fills_and_pick_the_same_tokens(manager):
    on, hits_on = _engine_walk(manager, seed=5)
    manager.state_keys = False
    try:
        off, _ = _engine_walk(manager, seed=5)
    finally:
        manager.state_keys = True
    assert on == off
    assert hits_on >= 20, hits_on
    assert manager.mask_cache.stats()["mask_cache_state_masks"] > 0
