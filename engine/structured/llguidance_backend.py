"""`GrammarBackend` on llguidance: compile specs, hand out matchers, fill bitmasks in parallel.

The tokenizer comes straight from tokenizer.json (llguidance parses the `tokenizers` JSON itself; no
transformers at run time). `vocab_size` is the model's: ids past the tokenizer's vocabulary are padding and
are never allowed. JSON is compact (`", "` and `": "` separators, no free whitespace): free whitespace lets a
model loop on newlines and makes outputs longer for no information.

llguidance has no separate "compiled grammar" object; a compiled grammar here is a template matcher whose
lexer and parser tables are built once, and each request gets a `deep_copy` of it (shares the built tables).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import torch
from deepinfer.engine.structured.backend import GrammarSpec
from deepinfer.engine.structured.normalize import choice_lark, prepare_json_schema, prepare_regex
from deepinfer.engine.structured.state_key import plan_of

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def default_threads() -> int:
    """Mask-filling threads: the CPUs this process may run on, at least 1, at most 16.

    Why all of them: the fills run while the device computes the forward, when the engine thread mostly
    waits, so they do not take CPU from it (measured on the H200 host, 16 cores, bench_structured
    --cold-cache: a JSON schema on every request cost 10.9% at 8 threads, 2.7% at 16). The affinity set,
    not os.cpu_count(): a container or `taskset` may allow fewer CPUs than the machine has."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def _library_message(kind: str, message: str) -> str:
    """Turn llguidance's error text into a user-facing message that names the problem."""
    text = " ".join(message.split())
    unimplemented = re.search(r"Unimplemented keys: \[(.*?)\]", text)
    if unimplemented:
        keys = [k.strip().strip('"') for k in unimplemented.group(1).split(",")]
        quoted = ", ".join(f"'{k}'" for k in keys)
        noun = "keyword" if len(keys) == 1 else "keywords"
        return (f"{kind}: unsupported {noun} {quoted} (the grammar backend cannot enforce "
                f"{'it' if len(keys) == 1 else 'them'}; remove {'it' if len(keys) == 1 else 'them'} "
                "or validate that part after generation)")
    if "oneOf constraints are not supported" in text:
        return (f"{kind}: unsupported 'oneOf' whose alternatives may overlap (only oneOf with provably "
                "disjoint alternatives is supported; use anyOf if any match is fine)")
    if "look-around" in text:
        return f"{kind}: unsupported pattern: look-ahead/look-behind assertions are not supported ({text})"
    return f"{kind}: {text}"


# Requests per template before another replica of a grammar is built (see LLGuidanceGrammar).
_REQUESTS_PER_REPLICA = 8


@dataclass
class LLGuidanceGrammar:
    """A compiled grammar: the spec and template matchers in their initial state (never advanced).

    Why replicas: a request's matcher is a deep copy of a template and shares the template's lazily built
    lexer and parser tables, and llguidance's executor threads filling masks of copies of one template
    slow each other down (H200 host, 147 rows of one JSON schema: p90 step fill 77 ms at 8 threads, the
    same as 1 thread; with one separately built template per thread 25 ms at 8, 19 ms at 16). So a grammar
    that many requests share gets up to one template per fill thread, built as requests arrive, and
    requests are dealt to them in turn. Every replica is built from the same grammar, so a matcher's masks
    do not depend on which replica it came from.
    """

    spec: GrammarSpec
    template: llguidance.LLMatcher
    build: Callable[[], llguidance.LLMatcher] | None = None   # builds one more replica (None: no more)
    state_plan: Any = None  # JSON Schemas with free strings: the state-key plan (state_key.py), else None
    max_replicas: int = 1
    replicas: list[llguidance.LLMatcher] = field(default_factory=list)
    handed_out: int = 0     # matchers made so far

    def next_template(self) -> llguidance.LLMatcher:
        """The template for the next request: replicas grow with the requests, then are dealt in turn."""
        if not self.replicas:
            self.replicas.append(self.template)
        wanted = min(self.max_replicas, 1 + self.handed_out // _REQUESTS_PER_REPLICA)
        if self.build is not None and len(self.replicas) < wanted:
            self.replicas.append(self.build())
        template = self.replicas[self.handed_out % len(self.replicas)]
        self.handed_out += 1
        return template


class LLGuidanceMatcher:
    """One request's grammar state (a deep copy of its grammar's template)."""

    __slots__ = ("_m", "_words")

    def __init__(self, m: llguidance.LLMatcher, words: int) -> None:
        self._m = m
        self._words = words

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(int(token_id))

    def fill_bitmask(self, row: torch.Tensor) -> None:
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("bitmask row: expected a contiguous int32 CPU tensor")
        if row.numel() != self._words:
            raise ValueError(f"bitmask row: {row.numel()} words, expected {self._words}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_error(self) -> bool:
        return self._m.is_error()

    def error(self) -> str:
        return self._m.get_error()

    def rollback(self, num_tokens: int) -> bool:
        return self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()


class LLGuidanceBackend:
    """Grammar backend for one tokenizer and model vocab size."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 max_threads: int | None = None) -> None:
        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("eos_token_ids: at least one end-of-sequence token id is needed")
        if any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids={eos}: ids must be in [0, vocab_size={vocab_size})")
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:
            raise ValueError(
                f"structured output: cannot use this tokenizer with model vocab_size={vocab_size}: {e}"
            ) from None
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.threads = max_threads if max_threads is not None else default_threads()
        # Batches always go through the executor, one thread included: its calls release the GIL, while a
        # matcher's own fill holds it for the whole row (measured: the engine thread makes no progress
        # during it), which on the mask worker would stall the engine's Python for the whole batch.
        self._executor = llguidance.LLExecutor(self.threads)

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        L = llguidance.LLMatcher
        plan = None
        if spec.kind == "json_schema":
            schema = prepare_json_schema(spec.value)
            if schema is False:
                raise ValueError("json_schema: the schema `false` accepts no value at all")
            if schema is True:
                schema = {}  # llguidance takes options only on object schemas; `true` is `{}`
            plan = plan_of(schema)  # before llguidance sees the dict (it may add its options to it)
            grammar = L.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = L.grammar_from_regex(prepare_regex(spec.value))
        else:
            grammar = L.grammar_from_lark(choice_lark(spec.value))
        template = L(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(_library_message(spec.kind, template.get_error()))
        return LLGuidanceGrammar(spec, template, build=lambda: L(self.tokenizer, grammar, log_level=0),
                                 max_replicas=self.threads, state_plan=plan)

    def new_matcher(self, grammar: LLGuidanceGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(grammar.next_template().deep_copy(), self.words)

    def fill_bitmasks(self, rows: list[tuple[int, LLGuidanceMatcher]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for each (row, matcher) on llguidance's thread pool (the GIL is released)."""
        if not rows:
            return
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous()
                or bitmask.dim() != 2 or bitmask.shape[1] != self.words):
            raise ValueError(f"bitmask: expected a contiguous int32 CPU tensor [*, {self.words}], got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if any(not 0 <= r < bitmask.shape[0] for r, _ in rows):
            raise ValueError(f"bitmask: a row index is outside [0, {bitmask.shape[0]})")
        if len(rows) == 1:  # one row: not worth the executor's hand-off
            for r, m in rows:
                m.fill_bitmask(bitmask[r])
            return
        self._executor.unsafe_compute_mask_ptr(
            [(m.raw, r) for r, m in rows], bitmask.data_ptr(), self.words * 4, bitmask.shape[0]
        )

    def token_bytes(self) -> list[bytes | None]:
        tok = self.tokenizer
        n = tok.vocab_size
        return [None if tok.is_special_token(i) else tok.decode_bytes([i]) for i in range(n)]
