"""Constraint rewrites (normalize.py) and the budget-steering building blocks (steering.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from deepinfer.engine.structured.normalize import (
    FORMAT_PATTERNS,
    ascii_classes,
    choice_lark,
    prepare_json_schema,
)
from deepinfer.engine.structured.steering import (
    EOS,
    STRING_CLOSE,
    STRUCT_CLOSE,
    STRUCT_SEPARATE,
    BudgetSteering,
    JsonLexState,
    pack_bits,
    steering_threshold,
)
from deepinfer.kernels.reference.token_mask import unpack_bitmask

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.parametrize(
    "regex,expected",
    [
        (r"\d{3}", "[0-9]{3}"),
        (r"[\dA-F]+", "[0-9A-F]+"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        (r"[^\w.]", "[^0-9A-Za-z_.]"),
        (r"\\d", r"\\d"),              # an escaped backslash followed by d stays literal
        (r"\s\.\p{L}", r"\s\.\p{L}"),  # other escapes untouched
    ],
)
def test_ascii_classes_rewrites_only_digit_and_word_classes(regex, expected):
    assert ascii_classes(regex) == expected


def test_date_pattern_agrees_with_the_format_checker():
    pattern = re.compile(FORMAT_PATTERNS["date"])
    years = [0, 1, 4, 100, 400, 1900, 1999, 2000, 2023, 2024, 2100, 9999]
    for y in years:
        for m in range(0, 14):
            for d in range(0, 33):
                s = f"{y:04d}-{m:02d}-{d:02d}"
                assert bool(pattern.fullmatch(s)) == FORMATS.conforms(s, "date"), s


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("date-time", "2024-02-29T23:59:59Z"), ("date-time", "2023-02-29T23:59:59Z"),
        ("date-time", "2024-01-01T23:59:60Z"), ("date-time", "2024-01-01T24:00:00Z"),
        ("date-time", "2024-01-01T12:00:00.123+05:30"), ("date-time", "0000-01-01T00:00:00Z"),
        ("time", "23:59:59Z"), ("time", "23:59:59"), ("time", "12:00:00.5-01:00"), ("time", "12:60:00Z"),
    ],
)
def test_format_patterns_agree_with_the_format_checker(fmt, text):
    assert bool(re.fullmatch(FORMAT_PATTERNS[fmt], text)) == FORMATS.conforms(text, fmt)


def test_schema_rewrite_walks_subschemas_but_never_values():
    schema = {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"},
                       "p": {"type": "string", "pattern": r"^\d+$", "format": "date-time"}},
        "$defs": {"x": {"anyOf": [{"type": "string", "pattern": r"\w"}]}},
        "const": {"format": "date", "pattern": r"\d"},
        "default": {"pattern": r"\d"},
    }
    out = prepare_json_schema(schema)
    assert out["properties"]["d"] == {"type": "string", "pattern": FORMAT_PATTERNS["date"]}
    assert out["properties"]["p"]["pattern"] == "^[0-9]+$"
    assert out["properties"]["p"]["allOf"] == [{"pattern": FORMAT_PATTERNS["date-time"]}]
    assert out["$defs"]["x"]["anyOf"][0]["pattern"] == "[0-9A-Za-z_]"
    assert out["const"] == {"format": "date", "pattern": r"\d"}
    assert out["default"] == {"pattern": r"\d"}
    assert schema["properties"]["d"]["format"] == "date"  # the caller's schema is not modified


def test_choice_grammar_quotes_every_choice():
    lark = choice_lark(['say "hi"', "a|b", "x", "x"])
    literals = lark.removeprefix("start: ").split(" | ")
    assert [json.loads(s) for s in literals] == ['say "hi"', "a|b", "x"]


# ---- steering ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chunks,in_string",
    [
        ([b'{"a'], True), ([b'{"a"'], False), ([b'{"a": "x\\', b'"'], True), ([b'"x\\\\', b'"'], False),
        ([b'[1, "', b'a"', b', "b'], True), ([b""], False),
    ],
)
def test_json_lex_state_tracks_strings_and_escapes(chunks, in_string):
    lex = JsonLexState()
    for c in chunks:
        lex.feed(c)
    assert lex.in_string == in_string


@pytest.mark.parametrize("max_tokens,expected",
                         [(None, None), (1, 0), (8, 4), (16, 8), (32, 8), (33, 9), (100, 25), (400, 100)])
def test_steering_threshold(max_tokens, expected):
    assert steering_threshold(max_tokens) == expected


def test_steering_sets_are_built_from_token_bytes():
    tokens = [None, b'"', b'"}', b"}", b"]}", b", ", b"a", b'a"', b"}a", b":", b'""']
    st = BudgetSteering(tokens, eos_token_ids=[0], vocab_size=12)
    sets = unpack_bitmask(torch.from_numpy(st.steer_bitmask), 12)
    members = {k: set(sets[k].nonzero().flatten().tolist()) for k in (EOS, STRING_CLOSE, STRUCT_CLOSE,
                                                                       STRUCT_SEPARATE)}
    assert members[EOS] == {0}
    assert members[STRING_CLOSE] == {1, 2}          # `"` then only closers/separators
    assert members[STRUCT_CLOSE] == {3, 4}
    assert members[STRUCT_SEPARATE] == {3, 4, 5, 9}
    assert st.single_byte_ids.tolist() == [1, 3, 6, 9]


def test_steer_json_keeps_the_grammar_mask_when_no_set_intersects():
    st = BudgetSteering([None, b'"', b"}", b"a", b"1"], eos_token_ids=[0], vocab_size=5)
    lex = JsonLexState()
    row = pack_bits(np.array([False, False, False, False, True]))  # only a digit allowed
    before = row.copy()
    assert st.steer_json_(row, lex) == -1 and (row == before).all()
    row = pack_bits(np.array([False, True, True, True, True]))
    assert st.steer_json_(row, lex) == STRUCT_CLOSE
    assert unpack_bitmask(torch.from_numpy(row)[None], 5)[0].tolist() == [False, False, True, False, False]
    lex.feed(b'"ab')
    row = pack_bits(np.array([False, True, True, True, True]))
    assert st.steer_json_(row, lex) == STRING_CLOSE
