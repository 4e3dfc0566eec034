"""Budget steering: when a constrained request is about to run out of tokens, steer it to a short ending.

A grammar mask keeps every output valid *if it finishes*; a request that hits max_tokens first finishes with
"length" and its output is not valid. Steering makes that rare. Once the remaining token budget is at most
`steering_threshold(max_tokens)` = max(8, ceil(25% of max_tokens)) — but never more than half the budget, so
the model always chooses freely for the first half (with small budgets, steering from the first token would
bias e.g. a choice between "y" and "yes please") — the row's grammar mask is AND-ed with the first of these
token sets that leaves something allowed:

  1. end-of-sequence tokens — the grammar can end here, so end;
  JSON Schema constraints, using the JSON lexical state of the output so far (`JsonLexState`):
  2. inside a string: tokens `"` followed only by `}` `]` `,` `:` or spaces — close the string;
     outside: tokens made only of `}` `]` — close the open array/object;
  3. outside a string: tokens made only of `}` `]` `,` `:` and spaces — on to the next required member
     rather than extending a number or opening new structure;
  regex and choice constraints:
  2. one-step lookahead over the allowed single-byte tokens: those after which the grammar can end
     (e.g. the final `.` of a sentence regex).

If no set intersects the grammar mask (a number that needs more digits, a pattern not yet satisfied) the
grammar mask is kept. Steering only removes tokens from the grammar mask, so validity is untouched; it
depends only on the row's own grammar state, output and remaining budget, so outputs stay batch-invariant
and deterministic. The token sets (`steer_bitmask`, int32 [4, ceil(V/32)]) are computed once per tokenizer.

Measured (benchmarks/bench_structured_compile.py, random walks at temperature 1.0 — a stress test: a walk
picks among allowed tokens with no preference for ending — over the 47 cases of spec_catalog.py,
8 walks each): demo tokenizer (576 ids) 92.0% finish within max_tokens without steering, 98.4% with it;
32k BPE tokenizer 65.4% -> 97.9%. No finished output was invalid either way. What still fails: the email
format (the grammar can close the string only after `@` and a domain, which no set here leads to).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

MIN_STEER_TOKENS = 8
STEER_FRACTION = 0.25
_QUOTE = ord('"')
_BACKSLASH = ord("\\")
_CLOSERS = frozenset(b"}]")
_SEPARATORS = frozenset(b",: ")

# Steering sets, in the order of `steer_bitmask` rows; LOOKAHEAD is computed per step, not stored.
EOS, STRING_CLOSE, STRUCT_CLOSE, STRUCT_SEPARATE, LOOKAHEAD = range(5)


def steering_threshold(max_tokens: int | None) -> int | None:
    """Remaining-budget level at or below which a request is steered; None when it has no budget."""
    if max_tokens is None:
        return None
    return min(max(MIN_STEER_TOKENS, math.ceil(STEER_FRACTION * max_tokens)), max_tokens // 2)


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> int32 [ceil(V/32)], token v at bit v % 32 of word v // 32 (the bitmask layout)."""
    v = allowed.shape[0]
    words = (v + 31) // 32
    padded = np.zeros(words * 32, dtype=np.uint64)
    padded[:v] = allowed
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))
    return (padded.reshape(words, 32) * weights).sum(axis=1).astype(np.uint32).view(np.int32)


class JsonLexState:
    """Whether the JSON text emitted so far ends inside a string (escape-aware), fed token by token."""

    __slots__ = ("in_string", "escaped")

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def feed(self, data: bytes) -> None:
        for b in data:
            if not self.in_string:
                self.in_string = b == _QUOTE
            elif self.escaped:
                self.escaped = False
            elif b == _BACKSLASH:
                self.escaped = True
            elif b == _QUOTE:
                self.in_string = False


class Lookahead(Protocol):
    def accept_token(self, token_id: int) -> bool: ...
    def is_accepting(self) -> bool: ...
    def rollback(self, num_tokens: int) -> bool: ...


class BudgetSteering:
    """The steering token sets of one tokenizer; `steer_json_` / `steer_lookahead_` narrow one mask row."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_ids: Iterable[int], vocab_size: int):
        sets = np.zeros((4, vocab_size), dtype=bool)
        sets[EOS, [t for t in eos_token_ids if 0 <= t < vocab_size]] = True
        single = []
        for i, tok in enumerate(token_bytes[:vocab_size]):
            if not tok:
                continue
            if len(tok) == 1:
                single.append(i)
            rest = tok[1:]
            sets[STRING_CLOSE, i] = tok[0] == _QUOTE and all(b in _CLOSERS | _SEPARATORS for b in rest)
            sets[STRUCT_CLOSE, i] = all(b in _CLOSERS for b in tok)
            sets[STRUCT_SEPARATE, i] = all(b in _CLOSERS | _SEPARATORS for b in tok)
        self.steer_bitmask = np.stack([pack_bits(s) for s in sets])
        self.set_sizes = [int(s.sum()) for s in sets]
        self.single_byte_ids = np.asarray(single, dtype=np.int64)

    def _narrow_(self, row: np.ndarray, which: int) -> bool:
        narrowed = np.bitwise_and(row, self.steer_bitmask[which])
        if narrowed.any():
            row[:] = narrowed
            return True
        return False

    def steer_json_(self, row: np.ndarray, lex: JsonLexState) -> int:
        """Narrow a JSON row; returns the set used (EOS, STRING_CLOSE, ...) or -1 when the mask is kept."""
        order = (EOS, STRING_CLOSE) if lex.in_string else (EOS, STRUCT_CLOSE, STRUCT_SEPARATE)
        for which in order:
            if self._narrow_(row, which):
                return which
        return -1

    def steer_lookahead_(self, row: np.ndarray, matcher: Lookahead) -> int:
        """Narrow a regex/choice row to EOS, else to single-byte tokens that complete the grammar."""
        if self._narrow_(row, EOS):
            return EOS
        ids = self.single_byte_ids
        allowed = ids[((row[ids >> 5] >> (ids & 31)) & 1).astype(bool)]
        finishing = []
        for t in allowed.tolist():
            if matcher.accept_token(t):
                if matcher.is_accepting():
                    finishing.append(t)
                matcher.rollback(1)
        if not finishing:
            return -1
        keep = np.zeros(row.shape[0] * 32, dtype=bool)
        keep[finishing] = True
        row[:] = pack_bits(keep)
        return LOOKAHEAD
