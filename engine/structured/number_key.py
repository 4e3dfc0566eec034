"""Exact grammar-state classes of an open JSON number: which digits were written mostly does not matter.

Why: in bench_structured's schema (`"confidence": {"type": "number", "minimum": 0, "maximum": 1}`,
sampled at temperature 1) every request writes a different digit string, and while the number is open a
key that keeps its bytes verbatim never meets another request's: measured on the 128k BPE (fillprobe.py
steps --by-state, one thread, steady state), 3,114 of the 3,179 rows still computed by llguidance
(98%) were inside that number.

The argument. A JSON number is one lexeme of llguidance's lexer, a regex R. While the bytes p of an open
number are being written the parser has not moved since the value started, so the mask depends on p only
through D_p(R) = {s : p+s in R}, the language of what may still follow (a token is allowed iff its bytes
continue a word of D_p(R), possibly ending the number and going on with what the grammar has after it;
EOS iff the whole output may end there). Prefixes with the same D_p(R) therefore have the same mask, and
the classes below are sets of prefixes with one D_p(R) each:
  - `{"type": "number"}` without bounds: R is JSON's number syntax,
    -?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)? (llguidance numeric.rs, rx_float_range(None, None)).
    D_p(R) is determined by the state of that syntax's automaton after p: MINUS, ZERO, INT (a nonzero
    integer, however many digits), DOT, FRAC, EXP_E, EXP_SIGN, EXP (e and E alike, + and - alike).
  - `{"type": "integer"}` without bounds: -?(0|[1-9][0-9]*): MINUS, ZERO, INT.
  - `{"type": "number", "minimum": a, "maximum": b}` with integers 0 <= a < b (or no maximum), both
    inclusive: llguidance builds R = I(\\.[0-9]+)? | b(\\.0+)?, I the integers of [a, b-1] in canonical
    form (rx_float_range with integer-valued bounds: no sign, no exponent; the fraction is free below b
    and zeros only at b; without a maximum, every integer >= a with a free fraction). So D_p(R) is a
    function of the integer digits and of whether `.` and a fraction digit were written, never of which
    fraction digits: the class is (integer digits verbatim, phase). At the integer b the only fraction
    digits R admits are zeros, so collapsing them loses nothing either. Without a maximum, R is
    rx_float_range(a, 10^n) | [1-9][0-9]{n,}(\\.[0-9]+)? (n the digits of a): an integer part longer than n
    digits is already > a, so every such prefix has D_p(R) = [0-9]*(\\.[0-9]+)? and they share one class
    (LONG) instead of their digits.
Everything else stays verbatim (the plan gives no NumberNode): exclusive, negative or fractional bounds
(there R makes fraction digits matter, e.g. an exclusive 0 needs a nonzero last digit), multipleOf,
bounded integers (their digits are the state; they are short anyway).

Checked against fresh llguidance fills: tests/engine/test_structured_number_key.py (every prefix of a
bounded length of several ranges, and random walks, with a deliberately wrong class shown to fail) and
`benchmarks/fillprobe.py steps --check` on the 128k BPE.
"""

from __future__ import annotations

from typing import Any

_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly"})
_NUMBER_KEYS = frozenset({"type", "minimum", "maximum"}) | _ANNOTATIONS
_MAX_BOUND = 1 << 53  # integers a float holds exactly (llguidance parses bounds as f64, then i64)

# Automaton states of the JSON number syntax (and of the phase of a range number).
MINUS, ZERO, INT, DOT, FRAC, EXP_E, EXP_SIGN, EXP = range(8)
_ACCEPTING = frozenset({ZERO, INT, FRAC, EXP})
_DIGITS = frozenset(b"0123456789")


class NumberNode:
    """A number value whose open state is a small class (see the module docstring).

    kind: "number" (no bounds), "integer" (no bounds) or "range" (integer bounds 0 <= minimum <
    maximum, maximum may be None: the integer digits are kept, the fraction collapses). long_after: for a
    range without maximum, the digits of its minimum (longer integer parts are one class), else None."""

    __slots__ = ("kind", "long_after")

    def __init__(self, kind: str, long_after: int | None = None) -> None:
        if kind not in ("number", "integer", "range"):
            raise ValueError(f"NumberNode kind={kind!r}: must be 'number', 'integer' or 'range'")
        if long_after is not None and (kind != "range" or long_after < 1):
            raise ValueError(f"NumberNode long_after={long_after}: only for a 'range', and >= 1")
        self.kind = kind
        self.long_after = long_after


def _integral(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return float(x).is_integer() and 0 <= x < _MAX_BOUND


def number_node(schema: dict) -> NumberNode | None:
    """The NumberNode of a `type: number` / `type: integer` schema, or None to keep it verbatim."""
    kind = schema.get("type")
    if kind not in ("number", "integer") or not set(schema) <= _NUMBER_KEYS:
        return None
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is None and hi is None:
        return NumberNode(kind)
    if kind != "number" or not _integral(lo) or not (hi is None or (_integral(hi) and lo < hi)):
        return None
    return NumberNode("range", len(str(int(lo))) if hi is None else None)


def start(node: NumberNode, b: int) -> Any:
    """The class after the number's first byte `b`, or None when R cannot start with it."""
    return step(node, None, b)


def step(node: NumberNode, state: Any, b: int) -> Any:
    """The class after one more byte (state None: before the first byte), or None when p+b is not a
    prefix of a word of R (the tracker then loses its key: a byte it did not expect)."""
    if node.kind == "range":
        return _range_step(state, b, node.long_after)
    digit = b in _DIGITS
    if state is None:
        if b == 0x2D:  # '-'
            return MINUS
        return (ZERO if b == 0x30 else INT) if digit else None
    if state == MINUS:
        return (ZERO if b == 0x30 else INT) if digit else None
    if state == INT and digit:
        return INT
    if node.kind == "integer":
        return None
    if state in (ZERO, INT):
        return DOT if b == 0x2E else EXP_E if b in b"eE" else None
    if state == DOT:
        return FRAC if digit else None
    if state == FRAC:
        return FRAC if digit else EXP_E if b in b"eE" else None
    if state == EXP_E:
        return EXP_SIGN if b in b"+-" else EXP if digit else None
    if state in (EXP_SIGN, EXP):
        return EXP if digit else None
    return None


_LONG = b""  # the digits of an integer part longer than a maximum-less range's minimum (never empty else)


def _range_step(state: tuple[int, bytes] | None, b: int, long_after: int | None = None
                ) -> tuple[int, bytes] | None:
    """Range numbers: (phase, integer digits). The digits are kept as written (R decides which
    integers exist), or _LONG past `long_after` digits; the phase is INT, DOT or FRAC (which fraction
    digits is collapsed)."""
    digit = b in _DIGITS
    if state is None:
        return (ZERO if b == 0x30 else INT, bytes((b,))) if digit else None
    phase, digits = state
    if phase == INT and digit:
        if digits is _LONG or (long_after is not None and len(digits) >= long_after):
            return (INT, _LONG)
        return (INT, digits + bytes((b,)))
    if phase in (ZERO, INT):
        return (DOT, digits) if b == 0x2E else None
    if phase in (DOT, FRAC):
        return (FRAC, digits) if digit else None
    return None


def accepting(node: NumberNode, state: Any) -> bool:
    """Whether the number may end in this class (a terminator byte then completes the value)."""
    if node.kind == "range":
        return state is not None and state[0] in _ACCEPTING
    return state in _ACCEPTING
