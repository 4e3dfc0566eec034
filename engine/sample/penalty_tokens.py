"""The token ids a penalised row has seen, kept per sequence and grown with its outputs.

Penalties read, per row, which ids appear in the prompt or the outputs (repetition) and how often each id
appears in the outputs (presence, frequency). Rebuilding that from the token lists every step costs
O(prompt + outputs) of Python per row and step (with dense tables, ~20 ms of host for a 256-row step at
512 + ~128 tokens: benchmarks/RESULTS.md, 2026-12-04 03:00); a
`PenaltyTokens` is built once from the prompt and then takes only the outputs appended since its last
`sync`. A step's rows are packed as sparse entries (`pack_entries`): (row, id, output count) for each
distinct id, so the device never builds a [rows, vocab] table either.

Entry order (a pure function of the token lists, whatever order the outputs were synced in): the prompt's
distinct ids ascending, then the other output ids in order of first appearance. Ids outside [0, vocab)
are dropped (they can never be sampled). A request without a repetition penalty gets no prompt entries
(`penalised_prompt`): presence and frequency read output counts only, and an entry with count 0 would
leave its logit as it is, so the step packs ~5x fewer entries for the OpenAI-style penalties.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer.engine.core.sequence import PENDING_TOKEN

if TYPE_CHECKING:
    from deepinfer.engine.core.sequence import Sequence
    from deepinfer.engine.sample.params import SamplingParams


class PenaltyTokens:
    """Distinct ids of one sequence's prompt and outputs, with each id's output count (host numpy)."""

    __slots__ = ("vocab_size", "_data", "_ids", "_counts", "_index", "_size", "_prompt_size", "_consumed")

    def __init__(self, prompt: SequenceABC[int], vocab_size: int) -> None:
        ids = np.unique(np.asarray(prompt, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        self.vocab_size = vocab_size
        self._prompt_size = self._size = int(ids.size)
        # Row 0 the ids, row 1 their output counts: one slice per table when a step packs its rows.
        self._data = np.zeros((2, max(16, 2 * self._size)), dtype=np.int32)
        self._ids, self._counts = self._data   # row views: 1-D item access is the fast one
        self._ids[: self._size] = ids
        self._index: dict[int, int] = dict(zip(ids.tolist(), range(self._size), strict=True))
        self._consumed = 0   # outputs taken in so far

    @property
    def entries(self) -> np.ndarray:
        """int32 [2, size]: the distinct ids and their output counts (0 for an id seen only in the prompt);
        a view, valid until the next `sync`."""
        return self._data[:, : self._size]

    def entries_with(self, extra: SequenceABC[int]) -> np.ndarray:
        """int32 [2, n]: `entries` as if `extra` (a verify row's drafts) were appended outputs; a copy, the
        table itself unchanged."""
        ids, counts = self._ids[: self._size].tolist(), self._counts[: self._size].tolist()
        new: dict[int, int] = {}
        for t in extra:
            if not 0 <= t < self.vocab_size:
                continue
            k = self._index.get(t, new.get(t))
            if k is None:
                k = new[t] = len(ids)
                ids.append(t)
                counts.append(0)
            counts[k] += 1
        return np.array([ids, counts], dtype=np.int32).reshape(2, -1)

    def sync(self, outputs: SequenceABC[int]) -> PenaltyTokens:
        """Take in the outputs appended since the last call; returns self.

        Stops at a PENDING_TOKEN (the overlapped loop's placeholder, replaced by its real id later) so the
        placeholder is never counted. Fewer outputs than already taken (a placeholder popped after an error)
        restarts from the prompt."""
        n = len(outputs)
        if n == self._consumed:
            return self
        if n < self._consumed:
            self._restart()
        index, counts = self._index, self._counts
        for i in range(self._consumed, n):
            t = outputs[i]
            if t == PENDING_TOKEN:
                break
            self._consumed = i + 1
            if not 0 <= t < self.vocab_size:
                continue
            k = index.get(t)
            if k is not None:
                counts[k] += 1
            else:
                self._append(t)
                counts = self._counts   # the arrays may have grown
        return self

    def _append(self, token: int) -> None:
        """A new id with output count 1 (the slot may hold a count from before a restart)."""
        k = self._size
        if k == self._ids.size:
            self._data = np.concatenate([self._data, np.zeros_like(self._data)], axis=1)
            self._ids, self._counts = self._data
        self._ids[k] = token
        self._counts[k] = 1
        self._index[token] = k
        self._size = k + 1

    def _restart(self) -> None:
        for t in self._ids[self._prompt_size : self._size].tolist():
            del self._index[t]
        self._size = self._prompt_size
        self._counts[: self._size] = 0
        self._consumed = 0


def penalised_prompt(params: SamplingParams, prompt: SequenceABC[int]) -> SequenceABC[int]:
    """The prompt ids whose logits a row's penalties can change: all under a repetition penalty, else none."""
    return prompt if params.repetition_penalty != 1.0 else ()


def sequence_entries(seq: Sequence, vocab_size: int, extra: SequenceABC[int] = ()) -> np.ndarray:
    """int32 [2, n] entries of `seq` (its outputs so far, plus `extra` uncommitted ones such as drafts) from
    its table: made on first use and kept on the sequence (`penalty_tokens`), so later steps take in only
    their new outputs."""
    table = seq.penalty_tokens
    if table is None or table.vocab_size != vocab_size:
        table = seq.penalty_tokens = PenaltyTokens(penalised_prompt(seq.params, seq.prompt_token_ids),
                                                   vocab_size)
    table.sync(seq.output_token_ids)
    return table.entries_with(extra) if extra else table.entries


def pack_entries(rows: list[np.ndarray]) -> torch.Tensor:
    """int32 [3, E] host tensor: per entry (index into `rows`, token id, output count), row by row, from
    each row's int32 [2, n] (`PenaltyTokens.entries`)."""
    sizes = [r.shape[1] for r in rows]
    out = np.empty((3, sum(sizes)), dtype=np.int32)
    out[0] = np.repeat(np.arange(len(rows), dtype=np.int32), sizes)
    if rows:
        np.concatenate(rows, axis=1, out=out[1:])
    return torch.from_numpy(out)
