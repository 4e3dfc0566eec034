"""The engine's handle on structured output: builds the StructuredOutputManager when a constrained request
first needs it.

Building the manager imports llguidance and compiles the tokenizer vocabulary for it (seconds for a large
vocabulary), so an engine that only ever serves unconstrained requests must never build one. The engine
components (engine core, model runner, finish rules) all hold this one handle from their constructors; its
calls are no-ops (or None) until a constrained request has made the manager exist.

`DEEPINFER_MASK_PREFETCH=0` turns off filling a request's next mask as soon as its grammar advances (masks
are then filled when the step samples; outputs are the same): for measuring what the prefetch hides.
`DEEPINFER_MASK_CACHE=0` turns off the exact mask cache by token history (mask_cache.py; same masks).
`DEEPINFER_MASK_STATE_KEYS=0` keeps JSON Schemas on token histories instead of grammar-state keys
(state_key.py; same masks).
`DEEPINFER_MASK_INLINE_HITS=0` queues every row to the mask worker, stored masks included, instead of
copying those at once on the engine thread (mask_slots.py; same masks).
`DEEPINFER_MASK_THREADS=N` sets llguidance's mask-filling threads (default: the CPUs this process may run
on, at most 16; llguidance_backend.default_threads says why), for sweeping it on a host: its executor does
not scale with threads on every machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from deepinfer.engine.core.sequence import Sequence as EngineSequence
    from deepinfer.engine.sample.params import SamplingParams
    from deepinfer.engine.structured.manager import StepMasks, StructuredOutputManager


class LazyStructuredOutputs:
    """The per-request structured-output calls of the engine, over a manager built on first need.

    tokenizer_json: path of the model's tokenizer.json. vocab_size: the model's logits width.
    eos_token_ids: ids that end a sequence. max_model_len: counted in each request's remaining budget.
    """

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Iterable[int],
                 max_model_len: int | None = None) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._manager: StructuredOutputManager | None = None

    @property
    def manager(self) -> StructuredOutputManager:
        """The manager, built now if no constrained request has needed it yet."""
        if self._manager is None:
            from deepinfer.engine.structured.manager import StructuredOutputManager

            threads = os.environ.get("DEEPINFER_MASK_THREADS")
            if threads is not None and not threads.isdigit():
                raise ValueError(f"DEEPINFER_MASK_THREADS={threads!r}: must be a positive integer")
            self._manager = StructuredOutputManager(
                self._tokenizer_json, self._vocab_size, self._eos_token_ids,
                max_threads=int(threads) if threads is not None else None,
                max_model_len=self._max_model_len,
                prefetch=os.environ.get("DEEPINFER_MASK_PREFETCH", "1") != "0",
                mask_cache_size=0 if os.environ.get("DEEPINFER_MASK_CACHE", "1") == "0" else 2048,
                state_keys=os.environ.get("DEEPINFER_MASK_STATE_KEYS", "1") != "0",
                inline_hits=os.environ.get("DEEPINFER_MASK_INLINE_HITS", "1") != "0",
            )
        return self._manager

    def validate(self, params: SamplingParams) -> None:
        """Compile a constrained request's grammar (building the manager); ValueError names the problem."""
        if params.constrained:
            self.manager.validate(params)

    def add(self, seq: EngineSequence) -> None:
        """Give a constrained request its grammar state when it enters the engine."""
        if seq.params.constrained:
            self.manager.add(seq)

    def masks_for(self, seqs: Sequence[EngineSequence]) -> StepMasks | None:
        """This step's masks for `seqs` (logits row i = seqs[i]), or None when none is constrained."""
        if self._manager is None:  # no constrained request was ever added, so no row has a grammar
            return None
        return self._manager.masks_for(seqs)

    def advance(self, seq: EngineSequence, token_id: int) -> bool:
        """Advance `seq`'s grammar on its sampled token; True when the grammar is complete."""
        if seq.grammar is None or self._manager is None:
            return False
        return self._manager.advance(seq, token_id)

    def free(self, seq: EngineSequence) -> None:
        """Drop `seq`'s grammar state (finished or aborted)."""
        if self._manager is not None:
            self._manager.free(seq)
