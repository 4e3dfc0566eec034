"""Structured output for the engine: the one owner of every request's grammar state.

Life of a constrained request (the engine reaches this through structured/lazy.py, which builds the manager
on the first constrained request):
  1. `validate(params)` when the request is made: compiles the constraint (cached by a canonical hash of
     kind + spec, shared by all requests) and raises ValueError naming the problem before any generation.
  2. `add(seq)` when it enters the engine: sets `seq.grammar` to a fresh `GrammarState` and queues the
     fill of its first mask (the initial state's: a copy from the mask cache after the first request).
  3. After sampling, `advance(seq, token)` moves the matcher on and says whether the grammar is complete;
     the finish rules (core/finish.py) then finish the request with "stop". EOS is allowed by the mask
     only where the grammar can end. A request that goes on has the fill of its next mask queued at once
     into its own slot row (mask_slots.py), on a worker thread (llguidance releases the GIL and spreads
     rows over its own threads): in the overlapped loop this is while the next step's forward runs.
  4. Each step, `masks_for(seqs)` collects the constrained rows (queueing a fill for any not yet queued,
     e.g. a request's first token); the returned `StepMasks.apply(logits)` waits only for the rows still
     being filled, applies budget steering, and masks (-inf) exactly those logits rows from their slots.
  5. `free(seq)` when the request finishes or is aborted (its slot is reused once its fill is done).
`new_matcher`, `accept`, `is_terminated` and `fill_bitmask(_async)` are the same steps on a bare
`GrammarState`, for callers without engine sequences (tests, random walks, benchmarks).

Rows on the same token history share one fill (mask_cache.py: an exact cache of the masks of shared
histories, e.g. every request's first mask and the schema's forced prefix); `mask_cache_size=0` turns it
off (same masks, for measuring it and for the tests that compare the two). JSON Schemas with free strings
or plain numbers are cached by grammar state instead (state_key.py: e.g. "12 characters into the 2nd
topic", number_key.py: "a fraction after the integer 0"), which also serves rows whose histories differ;
`state_keys=False` keeps them on token histories (same masks). A stored mask is copied into the row's slot
when its fill is queued, on the engine thread (mask_slots.py, `inline_hits`); only the rest go to the
worker.

Preemption / recompute and prefix-cache hits need nothing here: a matcher advances only on tokens the
request sampled (once each), never on recomputed or cached positions, so its state always equals "the
grammar after the request's output tokens". Masks depend only on a row's own state and remaining budget
(see steering.py), so masking is per row and keeps sampling batch-invariant.

A matcher must not be advanced while a fill that includes it is in flight (the engine applies the masks
and samples before it accepts tokens; `accept` waits for such a fill rather than race it).

A request that ends any other way than through its grammar is not a valid output: one that reaches
max_tokens first finishes with "length"; one whose matcher went into error (a token the mask forbade was
sampled — a sampler bug — or a grammar-library limit was hit; llguidance then allows only EOS) reports
`is_terminated` but not `is_valid_end`. Consumers that present parsed fields should check `is_valid_end`
(or re-validate the text with check.output_satisfies).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.structured.backend import GrammarSpec
from deepinfer.engine.structured.llguidance_backend import (
    LLGuidanceBackend,
    LLGuidanceGrammar,
    LLGuidanceMatcher,
)
from deepinfer.engine.structured.mask_cache import HistoryNode, MaskCache
from deepinfer.engine.structured.mask_slots import MaskSlots
from deepinfer.engine.structured.state_key import StateKey, char_counts
from deepinfer.engine.structured.steering import (
    MIN_STEER_TOKENS,
    BudgetSteering,
    JsonLexState,
    steering_threshold,
)
from deepinfer.engine.structured.step_masks import MaskRow, StepMasks

if TYPE_CHECKING:
    from deepinfer.engine.core.sequence import Sequence as EngineSequence


class GrammarState:
    """One request's structured-output state: its matcher and the budget level where steering starts.

    slot: its row in the manager's slot buffer (-1: none yet); fill: the fill of that row from the
    matcher's current state (None: not queued since the last token); steered: the row was narrowed by
    budget steering after that fill (a second masking of the same state refills it first); node: its token
    history in the manager's mask cache (None: not cached, e.g. a bare state or a matcher in error); skey: its
    grammar-state key instead (state_key.py; grammars with a state-key plan), None otherwise."""

    __slots__ = ("matcher", "spec", "steer_below", "lex", "slot", "fill", "steered", "node", "skey")

    def __init__(self, matcher: LLGuidanceMatcher, spec: GrammarSpec, steer_below: int) -> None:
        self.matcher = matcher
        self.spec = spec
        self.steer_below = steer_below
        # JSON outputs: whether the text so far ends inside a string (steering needs it).
        self.lex = JsonLexState() if spec.kind == "json_schema" else None
        self.slot = -1
        self.fill: Future | None = None
        self.steered = False
        self.node: HistoryNode | None = None
        self.skey: StateKey | None = None

    def cache_key(self) -> HistoryNode | tuple | None:
        """What the mask cache knows this state by: its state key, else its token-history node."""
        return self.skey.key if self.skey is not None else self.node


def _tokenizer_json(tokenizer: Any) -> str:
    if isinstance(tokenizer, (str, Path)):
        text = str(tokenizer)
        if text.lstrip().startswith("{"):
            return text
        path = Path(text)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"structured output: tokenizer file {path} does not exist")
        return path.read_text(encoding="utf-8")
    for obj in (tokenizer, getattr(tokenizer, "backend_tokenizer", None), getattr(tokenizer, "_tok", None)):
        if obj is not None and callable(getattr(obj, "to_str", None)):
            return obj.to_str()
    raise ValueError(
        f"structured output: cannot read a tokenizer from {type(tokenizer).__name__}; pass the path of "
        "tokenizer.json, its JSON text, or a `tokenizers.Tokenizer`"
    )


def spec_of(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint in canonical form, or None when it is unconstrained."""
    if params.json_schema is not None:
        if params.json_schema_mode == "validate":  # the grammar enforces what it can; the rest is checked
            from deepinfer.engine.structured.enforceable import check_validator, grammar_schema

            check_validator(params.json_schema)
            return GrammarSpec.of("json_schema", grammar_schema(params.json_schema))
        return GrammarSpec.of("json_schema", params.json_schema)
    if params.regex is not None:
        return GrammarSpec.of("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec.of("choice", list(params.choice))
    return None


class StructuredOutputManager:
    """Compiles and caches constraints for one tokenizer + model vocab size and computes token masks.

    tokenizer: path of tokenizer.json (or its directory), its JSON text, or a `tokenizers.Tokenizer`.
    vocab_size: the model's vocab size (logits width); ids past the tokenizer's vocabulary are never allowed.
    eos_token_ids: the ids that end a sequence; the mask allows them exactly where the grammar can end.
    max_threads: threads that fill masks in parallel. steering: budget steering on (see steering.py).
    max_model_len: when given, the remaining budget also counts the model-length limit.
    prefetch: queue a request's next mask as soon as its grammar advances (off: only when the step samples;
    same masks, for measuring what the prefetch hides). mask_cache_size: masks of shared token histories
    kept (mask_cache.py; 0: off, every row computed by llguidance). state_keys: cache JSON Schemas with free
    strings or number classes by grammar state (state_key.py; off: by token history; same masks).
    inline_hits: copy stored masks on the engine thread when a fill is queued (mask_slots.py; off: through
    the mask worker; same masks).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 max_threads: int | None = None, *, steering: bool = True, cache_size: int = 1024,
                 max_model_len: int | None = None, prefetch: bool = True,
                 mask_cache_size: int = 2048, state_keys: bool = True, inline_hits: bool = True) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r}: must be a positive integer")
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads={max_threads}: must be >= 1 or None")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size}: must be >= 1")
        if mask_cache_size < 0:
            raise ValueError(f"mask_cache_size={mask_cache_size}: must be >= 0 (0 turns the mask cache off)")
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prefetch = prefetch
        self.state_keys = state_keys
        self.backend = LLGuidanceBackend(_tokenizer_json(tokenizer), vocab_size, self.eos_token_ids,
                                         max_threads)
        self._token_bytes = self.backend.token_bytes()
        self._token_chars: list[int] | None = None  # char_counts(token bytes), built with the first StateKey
        self.steering = (BudgetSteering(self._token_bytes, self.eos_token_ids, vocab_size)
                         if steering else None)
        self._cache: OrderedDict[str, LLGuidanceGrammar | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar")
        # Engine requests' masks live in per-request slots, filled ahead of the step (mask_slots.py).
        self.mask_cache = MaskCache(self.backend.words, max_masks=mask_cache_size)
        self.slots = MaskSlots(self.backend, cache=self.mask_cache if mask_cache_size > 0 else None,
                               inline_hits=inline_hits)
        self.wait_seconds = 0.0    # time sampling waited for fills (the part of filling not overlapped)
        self.mask_steps = 0
        self.mask_rows = 0
        # Per masked step (fill seconds since the previous step, wait seconds, rows), bounded: the benchmark
        # reports medians and tails from it, since a few slow steps can dominate the mean.
        self.step_log: list[tuple[float, float, int]] = []
        self._fill_mark = 0.0

    @property
    def bitmask_words(self) -> int:
        return self.backend.words

    # ---- constraints ---------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        """The compiled grammar of `spec` (cached, errors included); raises ValueError for a bad spec."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self.backend.compile(spec)
            except ValueError as e:
                hit = str(e)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def validate(self, params: SamplingParams) -> None:
        """Compile the request's constraint now; ValueError names what is unsupported or invalid."""
        spec = spec_of(params)
        if spec is not None:
            self.compile(spec)

    def new_matcher(self, params: SamplingParams) -> GrammarState:
        spec = spec_of(params)
        if spec is None:
            raise ValueError("new_matcher: the request has no json_schema, regex or choice constraint")
        grammar = self.compile(spec)
        threshold = steering_threshold(params.max_tokens)
        if threshold is None:  # no max_tokens: only the model-length budget (if known) can run short
            threshold = MIN_STEER_TOKENS
        state = GrammarState(self.backend.new_matcher(grammar), spec, threshold)
        if self.state_keys and grammar.state_plan is not None and self.mask_cache.enabled:
            if self._token_chars is None:
                self._token_chars = char_counts(self._token_bytes)
            state.skey = StateKey(grammar.state_plan, spec.key)
        return state

    # ---- per step --------------------------------------------------------------------------------
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An all-allowed int32 [num_rows, ceil(vocab_size/32)] CPU bitmask (pinned when CUDA is present)."""
        return torch.full((num_rows, self.bitmask_words), -1, dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())

    def fill_bitmask(self, rows: Sequence[MaskRow], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for each (row, state, remaining_budget), steering rows short of budget."""
        self.backend.fill_bitmasks([(r, st.matcher) for r, st, _ in rows], bitmask)
        if self.steering is None:
            return
        view = bitmask.numpy()
        for r, st, remaining in rows:
            if remaining is None or remaining > st.steer_below or st.matcher.is_terminated():
                continue
            if st.lex is not None:
                self.steering.steer_json_(view[r], st.lex)
            else:
                self.steering.steer_lookahead_(view[r], st.matcher)

    def fill_bitmask_async(self, rows: Sequence[MaskRow], bitmask: torch.Tensor) -> Future:
        """`fill_bitmask` on the worker thread; the Future resolves (to None) when every row is filled."""
        return self._pool.submit(self.fill_bitmask, list(rows), bitmask)

    def remaining_budget(self, seq: EngineSequence) -> int | None:
        """Tokens the request may still generate, counting the token about to be sampled."""
        budgets = []
        if seq.params.max_tokens is not None:
            budgets.append(seq.params.max_tokens - seq.num_output_tokens)
        if self.max_model_len is not None:
            budgets.append(self.max_model_len - seq.num_tokens)
        return min(budgets) if budgets else None

    def masks_for(self, seqs: Sequence[EngineSequence]) -> StepMasks | None:
        """The masks of the sequences sampling this step (logits row i = seqs[i]); fills not queued yet
        (a request's first token) are queued now. Returns None when none of them is constrained."""
        rows: list[MaskRow] = []
        for i, seq in enumerate(seqs):
            st = seq.grammar
            if st is None:
                continue
            if st.slot < 0:
                st.slot = self.slots.acquire()
            if st.fill is None:
                st.fill = self.slots.submit(st.slot, st.matcher, st.cache_key())
                st.steered = False
            rows.append((i, st, self.remaining_budget(seq)))
        return StepMasks(self, rows) if rows else None

    def use_mask_cache(self, on: bool) -> None:
        """Serve fills from the mask cache (on) or compute every row with llguidance (off; same masks)."""
        if on and self.mask_cache.enabled:
            self.slots.cache = self.mask_cache
        else:
            self.slots.wait_idle()
            self.slots.cache = None

    def record_step(self, waited: float, rows: int) -> None:
        """Log one masked step: the worker's fill time since the previous step, the wait, the rows."""
        fill = self.slots.fill_seconds
        if len(self.step_log) < 1_000_000:
            self.step_log.append((fill - self._fill_mark, waited, rows))
        self._fill_mark = fill

    def mask_stats(self) -> dict[str, float | int]:
        """Cumulative mask counters: fill time on the worker, the part of it sampling waited for, and the
        mask cache's lookups and hits (rows copied from a stored mask or from a row of the same fill)."""
        fill = self.slots.fill_seconds
        return {"mask_steps": self.mask_steps, "mask_rows": self.mask_rows,
                "fill_seconds": fill, "fill_batches": self.slots.fill_batches,
                "filled_rows": self.slots.filled_rows, "inline_rows": self.slots.inline_rows,
                "wait_seconds": self.wait_seconds,
                "overlapped_fraction": max(0.0, 1.0 - self.wait_seconds / fill) if fill > 0 else 0.0,
                **self.mask_cache.stats()}

    def accept(self, state: GrammarState, token_id: int) -> bool:
        """Advance on the sampled token; False if the grammar rejects it (the matcher is then in error)."""
        fill = state.fill
        if fill is not None:
            if fill is not self.slots.done:  # a row copied at submit: nothing ran (skips Future's lock)
                fill.exception()  # never advance a matcher under a fill in flight
            state.fill = None
        ok = state.matcher.accept_token(token_id)
        if state.skey is not None:
            if ok and 0 <= token_id < len(self._token_bytes):
                state.skey.feed_token(self._token_bytes[token_id], self._token_chars[token_id])
            else:
                state.skey.lost = True  # off the state keys for good: computed from now on
        if state.node is not None:  # a rejected token puts the matcher in error: off the history trie
            state.node = self.mask_cache.step(state.node, token_id if ok else None)
        if ok and state.lex is not None and 0 <= token_id < len(self._token_bytes):
            state.lex.feed(self._token_bytes[token_id] or b"")
        return ok

    def is_terminated(self, state: GrammarState) -> bool:
        """True when the output is complete: the grammar cannot continue or EOS was accepted."""
        return state.matcher.is_terminated()

    def is_valid_end(self, state: GrammarState) -> bool:
        """True when the output so far is a complete, valid match (ending here would be valid)."""
        m = state.matcher
        return not m.is_error() and (m.is_accepting() or m.is_terminated())

    # ---- engine requests: the one place seq.grammar is created, advanced and dropped ------------------
    def add(self, seq: EngineSequence) -> None:
        """Give a constrained request its grammar state (unconstrained requests are left alone)."""
        if seq.params.constrained:
            seq.grammar = self.new_matcher(seq.params)
            state = seq.grammar
            state.slot = self.slots.acquire()
            if state.skey is None:  # keyed by state: the token-history trie is not needed
                state.node = self.mask_cache.start(state.spec.key)
            if self.prefetch:  # the first mask is known now: fill it while the prompt is prefilled
                state.fill = self.slots.submit(state.slot, state.matcher, state.cache_key())

    def advance(self, seq: EngineSequence, token_id: int) -> bool:
        """Advance `seq`'s grammar on its newly sampled token; True when the grammar is now complete.

        A rejected token is not raised here: the matcher goes into error, which counts as complete (the
        request then ends with "stop" but not `is_valid_end`, see the module docstring)."""
        state = seq.grammar
        if state is None:
            return False
        self.accept(state, token_id)
        done = self.is_terminated(state)
        remaining = self.remaining_budget(seq)
        if self.prefetch and not done and state.slot >= 0 and (remaining is None or remaining > 0):
            # The request samples again: fill its next mask now, while the engine goes on (the overlapped
            # loop is applying this step's tokens with the next forward already on the device).
            state.fill = self.slots.submit(state.slot, state.matcher, state.cache_key())
            state.steered = False
        return done

    def free(self, seq: EngineSequence) -> None:
        """Drop `seq`'s grammar state (finished or aborted); no-op for unconstrained requests."""
        state = seq.grammar
        if state is not None:
            self.slots.release(state.slot, state.fill)
            state.slot, state.fill = -1, None
            self.mask_cache.leave(state.node)
            state.node = None
        seq.grammar = None

    def close(self) -> None:
        """Stop the mask-filling worker threads (waits for a fill in flight)."""
        self._pool.shutdown(wait=True)
        self.slots.close()
