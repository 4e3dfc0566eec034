"""Incremental detokenization with stop strings.

Decoding the whole output after every token is quadratic, and decoding each token alone is wrong: byte-level
BPE tokens can hold part of a UTF-8 character, and SentencePiece-style decoders treat the first token of a
decode specially (leading space). So the detokenizer decodes a small window of recent tokens:

    ids[prefix_offset:read_offset]   text already emitted (kept only as context)
    ids[read_offset:]                tokens whose text is not emitted yet

After each token it decodes the window and, when the text grew and does not end in U+FFFD (an incomplete
multi-byte character renders as U+FFFD), emits the growth and slides the window forward. Text is therefore
only emitted once its characters are complete.

Stop strings are matched on the emitted (complete) text, including matches that span earlier text. Text that
could still become the start of a stop string is held back, so what ``add_token`` returned never has to be
taken back: the concatenation of every ``add_token`` result and ``finish()`` is exactly ``text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as context before the first output token (enough for any decoder's leading-space
# rule, cheap to decode).
PROMPT_CONTEXT_TOKENS = 5
# A window that keeps ending in U+FFFD beyond this many held tokens holds invalid bytes (a UTF-8 character
# is at most 4 bytes); its text up to the last boundary that can no longer change is then emitted, so the
# decoding cost per token stays bounded.
MAX_HELD_TOKENS = 32
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn a stream of generated token ids into text, stopping at stop strings.

    ``text`` is the output so far (truncated before the matched stop string, or just after it when
    ``include_stop_str_in_output``). After a stop string matched, ``stopped`` is True, ``stop_str`` names it
    and further ``add_token`` calls return "". For byte-level BPE the final text equals
    ``tokenizer.decode(output_ids, skip_special_tokens)`` exactly (up to a stop string); decoders with a
    leading-space rule keep the space the first output token has after the prompt.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        stops = list(stop or [])
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]={s!r}: stop strings must be non-empty strings")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = stops
        self._include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if PROMPT_CONTEXT_TOKENS else []
        prefix_text = self._decode(context)
        if prefix_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its completion would rewrite context text, so start clean.
            context, prefix_text = [], ""
        # Window of ids: [0:read) already emitted (context), [read:) pending.
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = prefix_text
        self._stable = ""          # complete text so far (before any stop truncation)
        self._emitted = 0          # chars of the final text already returned
        self.stopped = False
        self.stop_str: str | None = None
        self._final: str | None = None  # the output text once stopped or finished

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    @property
    def text(self) -> str:
        """All output text returned so far (``add_token`` results plus ``finish()``)."""
        if self._final is not None:
            return self._final[: self._emitted]
        return self._stable[: self._emitted]

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the text that became final with it ("" if none)."""
        if self.stopped or self._final is not None:
            return ""
        self._window.append(token_id)
        new_text = self._decode(self._window)
        held = len(self._window) - self._read
        grew = len(new_text) > len(self._prefix_text)
        if not grew or new_text.endswith(_REPLACEMENT):
            if held < MAX_HELD_TOKENS:
                return ""
            cut = self._final_cut(new_text)
            new_text = self._decode(self._window[:cut])
            grew = len(new_text) > len(self._prefix_text)
        else:
            cut = len(self._window)
        if grew:
            before = len(self._stable)
            self._stable += new_text[len(self._prefix_text):]
            self._check_stop(before)
        self._slide(cut)
        return self._release()

    def _final_cut(self, full: str) -> int:
        """The last token boundary whose text before it can no longer change (for a long run of invalid
        bytes): decoding both sides apart gives the same text as decoding them together, so the bytes
        after it do not continue a character before it. Falls back to everything."""
        for cut in range(len(self._window) - 1, self._read, -1):
            left = self._decode(self._window[:cut])
            if len(left) >= len(self._prefix_text) and left + self._decode(self._window[cut:]) == full:
                return cut
        return len(self._window)

    def _slide(self, cut: int) -> None:
        """Drop emitted context: tokens [read, cut) become the next context, the rest stays pending."""
        self._window = self._window[self._read:]
        self._read = cut - self._read
        self._prefix_text = self._decode(self._window[: self._read])

    def _check_stop(self, before: int) -> None:
        """Stop at the match that ends first among those ending after ``before`` chars (ties: the one that
        starts first). Every earlier-ending match was seen at an earlier step, so the result is the same
        however the text arrived in pieces."""
        best: tuple[int, int, int] | None = None
        for k, s in enumerate(self._stops):
            pos = self._stable.find(s, max(0, before - len(s) + 1))
            if pos >= 0 and (best is None or (pos + len(s), pos) < best[:2]):
                best = (pos + len(s), pos, k)
        if best is None:
            return
        _, pos, k = best
        self.stopped = True
        self.stop_str = self._stops[k]
        end = pos + len(self.stop_str) if self._include_stop else pos
        self._final = self._stable[:end]

    def _holdback(self) -> int:
        """Chars at the end of the text that could be the start of a stop string."""
        text = self._stable
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self) -> str:
        if self._final is not None:
            limit = len(self._final)
            source = self._final
        else:
            source = self._stable
            limit = len(source) - self._holdback()
        if limit <= self._emitted:
            return ""
        out = source[self._emitted:limit]
        self._emitted = limit
        return out

    def finish(self) -> str:
        """End of generation: return all text still held back (an incomplete trailing character renders as
        U+FFFD, exactly as a full decode would; a possible stop-string prefix is final now)."""
        if self._final is None:
            if len(self._window) > self._read:
                new_text = self._decode(self._window)
                if len(new_text) > len(self._prefix_text):
                    before = len(self._stable)
                    self._stable += new_text[len(self._prefix_text):]
                    self._check_stop(before)
                self._slide(len(self._window))
            if self._final is None:
                self._final = self._stable
        return self._release()


def decode_output(tokenizer: _Decoder, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                  skip_special_tokens: bool = True) -> str:
    """The text `IncrementalDetokenizer` would produce for these tokens (no stop strings), in one decode.

    A request without stop strings needs no text until it finishes, so the engine decodes its output once
    at the end instead of once per token. The same prompt context is used, so the result matches the
    incremental text (the tests compare them).
    """
    det = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    det._window.extend(output_token_ids)
    det.finish()
    return det.text
