"""Exact grammar-state keys for JSON Schemas: rows whose remaining grammar is the same share one mask.

Why: with a 128k vocabulary the dearest masks are inside length-bounded strings near their bound (measured
on bench_structured's schema, one thread: 1.2-2.8 ms a row with < 30 characters left of a `maxLength`,
against 50-130 us elsewhere): llguidance's slicer allows a whole class of tokens at once only while the
class fits ("any string piece of <= 10 / <= 30 characters"), so with fewer characters left it walks the
token trie for every token longer than what is left just to refuse it. Those states recur in every
request (what the grammar accepts after `"topics": ["abc` depends on how many characters the string
holds, not which), but keyed by token history (mask_cache.py) two random strings never meet.

The key. A mask is a function of the matcher's state, and llguidance's state of the bytes consumed (its
lexer and Earley parser run on bytes; token boundaries do not enter). The key is those bytes with two exact
abstractions, applied only on *settled* positions: the top value and values of objects and arrays the plan
reads (plain `type: object` with `properties`, `type: array` with one `items`; no anyOf/oneOf/allOf/$ref/
type lists on the way, property names literal and distinct), so no union of the grammar can depend on
what is abstracted. (1) A completed value collapses into one marker: after it, what is left is the
container's continuation whichever value it was (its end is unambiguous in JSON: a closing quote or
bracket, or the byte after a scalar). (2) While a *free string* is open (`type: string` with at most
`minLength`/`maxLength`) only its character count is kept: llguidance compiles it to `"` CHAR{min,max} `"`,
CHAR one unescaped character (anything but `"`, `\\` and controls) or an escape, so after k complete
characters CHAR{min-k,max-k} `"` is left, whichever characters they were. (3) While a number of a plain
`type: number` / `type: integer` (or a number with non-negative integer bounds) is open only its class is
kept (number_key.py: e.g. "a fraction with >= 1 digit after the integer 0"). Kept verbatim where that
needs more care: from a backslash on, the rest of that string; the pending bytes of a character split
across tokens; everything of an open value that is neither (keys, other numbers, enums, patterns,
formats, subschemas off the whitelist). An enum needs nothing more: after its first bytes what is left is
a function of those bytes, which recur across requests. A byte the tracker does not expect loses the key
for good (the row is then computed). Checked against fresh llguidance fills on random walks
(tests/engine/test_structured_state_key.py and test_structured_number_key.py on the demo tokenizer;
`benchmarks/fillprobe.py steps --check` on the 128k BPE).

`plan_of(schema)` (key_plan.py) reads a schema (as compiled, after normalize.py) into its nodes, or None
when nothing in it is abstracted (the token-history cache then stays in charge); `StateKey` follows one
request's bytes.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.engine.structured import number_key
from deepinfer.engine.structured.key_plan import (  # noqa: F401  (plan_of, char_counts: the module's API)
    ArrayNode,
    FreeString,
    NumberNode,
    ObjectNode,
    char_counts,
    plan_of,
)
from deepinfer.engine.structured.mask_cache import VERBATIM_MARK

MAX_KEY_BYTES = 2048  # longer keys (long verbatim text) are not served: bounded memory for the cache's keys

# Lexical states of the tracker.
_VALUE, _OBJ_KEY, _KEY, _COLON, _AFTER, _VSTR, _FREE, _SCALAR, _DONE, _NUM = range(10)
_OPEN_VERBATIM = frozenset({_VSTR, _KEY, _SCALAR})  # inside a value kept verbatim: key ends in VERBATIM_MARK
_NUM_MARK = "n"  # the third element of an open number's key (a free string's is its character count)
_QUOTE, _BSLASH, _SPACE = ord('"'), ord("\\"), ord(" ")
_DONE_VALUE = b"\x00"  # stands for a completed value's bytes (a raw NUL never occurs in JSON text)
# Per state, the run of bytes that only extend the current lexeme (copied in bulk by StateKey.feed).
_PLAIN = {_VSTR: re.compile(rb'[^"\\]*'), _KEY: re.compile(rb'[^"\\]*'), _SCALAR: re.compile(rb"[^,\]} ]*")}


class StateKey:
    """One request's state key, fed the bytes of each accepted token (see the module docstring).

    `key` is a hashable tuple, equal for two requests of the same grammar only when their states are equal
    (by the argument of the module docstring); None once the tracker met a byte it did not expect (for
    good) or while the key is longer than MAX_KEY_BYTES.
    """

    __slots__ = ("_tag", "_raw", "_rawb", "_stack", "_state", "_expect", "_vstart", "_keybuf", "_escaped",
                 "_free", "_count", "_pend", "_need", "_tail", "_numnode", "_num", "lost")

    def __init__(self, plan: Any, tag: str) -> None:
        self._tag = tag          # the grammar's identity (GrammarSpec.key): keys of two grammars never meet
        self._raw = bytearray()  # the key's bytes: the output with completed values collapsed
        self._rawb: bytes | None = None  # bytes(_raw) while _raw is unchanged (its hash is cached too)
        # Per open container: (is_object, its node or None (verbatim), where it starts in _raw or -1).
        self._stack: list[tuple[bool, Any, int]] = []
        self._state = _VALUE
        self._expect = plan      # node of the value about to start
        self._vstart = -1        # where the open string / scalar value starts in _raw (-1: not collapsed)
        self._keybuf = bytearray()
        self._escaped = False
        self._free: FreeString | None = None
        self._count = 0          # complete characters of the open free string
        self._pend = bytearray()  # bytes of a character split across tokens, or the verbatim tail
        self._need = 0           # continuation bytes the pending character still needs
        self._tail = False       # the open free string went verbatim (a backslash was seen)
        self._numnode: NumberNode | None = None  # the open number's node
        self._num: Any = None    # its class (number_key.py)
        self.lost = False

    @property
    def key(self) -> tuple | None:
        if self.lost or len(self._raw) > MAX_KEY_BYTES:
            return None
        raw = self._rawb
        if raw is None:
            raw = self._rawb = bytes(self._raw)
        st = self._state
        if st == _FREE:
            f = self._free
            count = self._count if f.max_len is not None else min(self._count, f.min_len)
            if self._tail:  # verbatim from a backslash on: may never recur (mask_cache.VERBATIM_MARK)
                return (self._tag, raw, count, bytes(self._pend), VERBATIM_MARK)
            return (self._tag, raw, count, bytes(self._pend))
        if st == _NUM:  # the number's bytes are not in _raw: its class stands for them
            return (self._tag, raw, _NUM_MARK, self._num)
        if st in _OPEN_VERBATIM:
            return (self._tag, raw, VERBATIM_MARK)
        return (self._tag, raw)

    def feed_token(self, data: bytes | None, chars: int) -> None:
        """Advance on one accepted token: its bytes (None: a special token) and `char_counts` entry."""
        if self.lost or data is None:  # a special token (EOS): nothing is masked after it
            self.lost = True
            return
        if chars >= 0 and self._state == _FREE and not self._need and not self._tail:
            self._count += chars  # the common case: a piece of text inside a free string
            return
        self.feed(data)

    def feed(self, data: bytes) -> None:
        self._rawb = None
        i, n = 0, len(data)
        while i < n and not self.lost:
            st = self._state
            # Inside a verbatim string, a key or a scalar the bytes up to the next one that matters are
            # only copied: one slice instead of a byte loop (most of a token outside free strings).
            plain = _PLAIN.get(st) if not self._escaped else None
            if plain is not None:
                m = plain.match(data, i)
                j = m.end()
                if j > i:
                    chunk = data[i:j]
                    self._raw += chunk
                    if st == _KEY:
                        self._keybuf += chunk
                    i = j
                    continue
            self._byte(data[i])
            i += 1

    def _settled(self) -> bool:
        """Whether a value starting now collapses once complete: at the top or in a container of the plan."""
        return not self._stack or self._stack[-1][1] is not None

    def _byte(self, b: int) -> None:
        st = self._state
        if st == _FREE:
            self._free_byte(b)
            return
        if st == _NUM:
            self._num_byte(b)
            return
        raw = self._raw
        raw.append(b)
        if st == _VSTR:
            if self._escaped:
                self._escaped = False
            elif b == _BSLASH:
                self._escaped = True
            elif b == _QUOTE:
                self._end_value(self._vstart)
        elif st == _KEY:
            if self._escaped:
                self._escaped = False
                self._keybuf.append(b)
            elif b == _BSLASH:
                self._escaped = True
                self._keybuf.append(b)
            elif b == _QUOTE:
                node = self._stack[-1][1]
                props = node.props if isinstance(node, ObjectNode) else {}
                self._expect = props.get(bytes(self._keybuf))
                self._state = _COLON
            else:
                self._keybuf.append(b)
        elif st == _SCALAR:
            if b in b",]} ":
                raw.pop()
                self._end_value(self._vstart)
                self._byte(b)
        elif b == _SPACE:
            pass
        elif st == _VALUE:
            raw.pop()
            self._start_value(b)
        elif st == _AFTER:
            self._after(b)
        elif st == _OBJ_KEY:
            if b == _QUOTE:
                self._keybuf.clear()
                self._state = _KEY
            elif b == ord("}"):
                raw.pop()
                self._close(True)
            else:
                self.lost = True
        elif st == _COLON:
            if b == ord(":"):
                self._state = _VALUE
            else:
                self.lost = True
        else:  # _DONE: nothing may follow the top value
            self.lost = True

    def _start_value(self, b: int) -> None:
        node, raw = self._expect, self._raw
        if b == ord("]") and self._stack and not self._stack[-1][0]:
            self._close(False)  # an empty array
            return
        start = len(raw) if self._settled() else -1
        raw.append(b)
        if b == ord("{") or b == ord("["):
            is_obj = b == ord("{")
            if node is not None and not isinstance(node, ObjectNode if is_obj else ArrayNode):
                self.lost = True
            self._stack.append((is_obj, node, start))
            self._expect = node.items if isinstance(node, ArrayNode) else None
            self._state = _OBJ_KEY if is_obj else _VALUE
        elif b == _QUOTE:
            self._vstart = start
            if isinstance(node, FreeString):
                self._free, self._count, self._tail, self._need = node, 0, False, 0
                self._pend.clear()
                self._state = _FREE
            elif node is None:
                self._escaped = False
                self._state = _VSTR
            else:
                self.lost = True
        elif isinstance(node, NumberNode):
            raw.pop()  # an open number is its class, not its bytes
            self._vstart, self._numnode, self._num = start, node, number_key.start(node, b)
            self._state = _NUM
            self.lost = self._num is None
        elif node is None and (b == ord("-") or ord("0") <= b <= ord("9") or b in b"tfn"):
            self._vstart = start
            self._state = _SCALAR
        else:
            self.lost = True

    def _after(self, b: int) -> None:
        if not self._stack:
            self.lost = True
            return
        is_obj, node, _ = self._stack[-1]
        if b == ord(","):
            if is_obj:
                self._state = _OBJ_KEY
            else:
                self._expect = node.items if isinstance(node, ArrayNode) else None
                self._state = _VALUE
        elif b == (ord("}") if is_obj else ord("]")):
            self._raw.pop()
            self._close(is_obj)
        else:
            self.lost = True

    def _close(self, is_obj: bool) -> None:
        """Close the innermost container (its bracket is not in _raw yet)."""
        if not self._stack or self._stack[-1][0] != is_obj:
            self.lost = True
            return
        _, _, start = self._stack.pop()
        self._raw.append(ord("}") if is_obj else ord("]"))
        self._end_value(start)

    def _end_value(self, start: int) -> None:
        """A value is complete: from `start` on (when >= 0) its bytes collapse into one marker."""
        if start >= 0:
            del self._raw[start:]
            self._raw += _DONE_VALUE
        self._vstart = -1
        self._state = _AFTER if self._stack else _DONE

    def _free_byte(self, b: int) -> None:
        pend = self._pend
        if self._tail:  # verbatim to the closing quote
            pend.append(b)
            if self._escaped:
                self._escaped = False
            elif b == _BSLASH:
                self._escaped = True
            elif b == _QUOTE:
                self._close_free()
            return
        if self._need:
            if not 0x80 <= b <= 0xBF:
                self.lost = True
                return
            pend.append(b)
            self._need -= 1
            if not self._need:
                pend.clear()
                self._count += 1
            return
        if b == _QUOTE:
            self._close_free()
        elif b == _BSLASH:
            self._tail, self._escaped = True, True
            pend.append(b)
        elif b < 0x20 or b == 0x7F:
            self.lost = True
        elif b < 0x80:
            self._count += 1
        elif 0xC2 <= b <= 0xF4:
            self._need = 1 if b < 0xE0 else 2 if b < 0xF0 else 3
            pend.append(b)
        else:
            self.lost = True

    def _num_byte(self, b: int) -> None:
        node = self._numnode
        nxt = number_key.step(node, self._num, b)
        if nxt is not None:
            self._num = nxt
        elif b in b",]} " and number_key.accepting(node, self._num):
            self._numnode = self._num = None
            self._end_value(self._vstart)  # a number of the plan is always settled: it collapses
            self._byte(b)
        else:
            self.lost = True

    def _close_free(self) -> None:
        self._pend.clear()
        self._free, self._tail, self._escaped = None, False, False
        self._end_value(self._vstart)
