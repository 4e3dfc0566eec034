r"""The grammar-backend interface behind structured output, and why llguidance implements it.

A backend turns a `GrammarSpec` (a JSON Schema, a regex or a list of choices) into a `CompiledGrammar`,
and a compiled grammar into per-request `Matcher`s that fill token bitmasks and advance on sampled tokens.
deepinfer ships one implementation, `LLGuidanceBackend` (llguidance_backend.py); an xgrammar backend is
deliberately left out (see the measurements below).

Choice of library — measured with benchmarks/bench_structured_compile.py on deepinfer's constraint table
(engine/structured/spec_catalog.py: 36 JSON Schemas, 7 regexes, 4 choice lists, and 17 specs that a library
must refuse), xgrammar 0.2.9 vs llguidance 1.9.1, both given the same specs (after normalize.py) and compact
JSON (no free whitespace), 5 seeded random walks per case, one thread, on a shared 2-core CPU. Timings are
the range over two runs under different machine load (compare within a run; the ratio is stable):

                                        xgrammar                      llguidance
  demo tokenizer (576-id model vocab)
    compile, median                     0.25 - 1.05 ms                0.38 - 0.96 ms
    mask per token, mean                1.9 - 5.7 us                  15 - 52 us
  32k byte-level BPE (32064 ids)
    compile, median                     0.70 - 12.6 ms (email 25 ms)  0.47 - 1.5 ms
    mask per token, mean                11 - 65 us                    26 - 108 us
  tokenizer info from tokenizer.json    0.8 - 2.9 s                   0.02 - 0.7 s
  import                                0.7 s (pulls in transformers) 0.005 s, no dependencies
  must-refuse specs refused             8/17                          17/17
    xgrammar accepts and does not enforce: uniqueItems, not, if/then, contains, dependentRequired,
    propertyNames, unevaluatedProperties, overlapping oneOf, look-around in patterns.
  finished walks that fail validation   17 (demo) / 6 (32k)           0 / 0
    xgrammar: raw control characters inside JSON strings (json.loads refuses them), allOf ignored
    (`0` accepted for an allOf of objects), `\.` dropped from `(?:\.[0-9]{1,9})?` in a pattern.

Before normalize.py, llguidance had 4 invalid walks, both semantic gaps rather than bugs: its `\d` is
Unicode (it produced U+1CCF9, a digit Python 3.11 does not know) and its date-time format admits leap
second 60, which the jsonschema format checker refuses. normalize.py closes both (ASCII classes; exact
patterns for date/time/date-time). xgrammar's failures cannot be fixed from outside.

The decision: llguidance. It refuses what it cannot enforce with a message naming the keyword, so
"always valid" holds; its mask is 2-8x slower per row in one thread, but tens of microseconds per row,
filled on worker threads while the GPU runs the forward pass (its mask calls release the GIL; llguidance's
Rust executor spreads a step's rows over threads), is hidden behind a multi-millisecond decode step.
An xgrammar backend is deliberately not provided.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

KINDS = ("json_schema", "regex", "choice")


@dataclass(frozen=True)
class GrammarSpec:
    """One request constraint in canonical form. `text` is canonical JSON (schema, choices) or the regex."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"GrammarSpec.kind={self.kind!r}: expected one of {KINDS}")

    @classmethod
    def of(cls, kind: str, spec: Any) -> GrammarSpec:
        """Canonical form: compact JSON *in the given key order*. Keys are deliberately not sorted: the
        order of `properties` is the order the object's members are generated in, so two schemas that
        differ only in that order are different constraints (sharing one grammar would make a request's
        output depend on which of them was compiled first)."""
        if kind == "regex":
            return cls(kind, spec)
        try:
            text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{kind}: not representable as JSON ({e})") from None
        return cls(kind, text)

    @property
    def key(self) -> str:
        """Cache key: kind + canonical text, so equal specs share one compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    @property
    def value(self) -> Any:
        return self.text if self.kind == "regex" else json.loads(self.text)


@runtime_checkable
class Matcher(Protocol):
    """One request's grammar state. Advances only on tokens the request actually sampled."""

    def accept_token(self, token_id: int) -> bool:
        """Advance on `token_id`; False (and an error state) when the grammar does not allow it."""

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask of the current state into `row` (int32 [ceil(V/32)], CPU)."""

    def is_terminated(self) -> bool:
        """True once nothing but end-of-sequence can follow (grammar complete, EOS accepted, or error)."""

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be allowed now)."""

    def is_error(self) -> bool: ...

    def rollback(self, num_tokens: int) -> bool: ...

    def reset(self) -> None: ...


@runtime_checkable
class CompiledGrammar(Protocol):
    spec: GrammarSpec


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer + model vocab size; masks are int32 [*, ceil(vocab_size / 32)]."""

    name: str
    vocab_size: int

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raise ValueError naming the unsupported feature or the invalid part of the spec."""

    def new_matcher(self, grammar: CompiledGrammar) -> Matcher: ...

    def fill_bitmasks(self, rows: list[tuple[int, Matcher]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for every (row, matcher), possibly in parallel; bitmask is CPU, contiguous."""

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each token id decodes to; None for special and padding ids."""
