"""A request's mutable state as it moves through the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.engine.sample.params import SamplingParams

if TYPE_CHECKING:  # annotations only: the structured, text and sample rooms import this module
    from deepinfer.engine.sample.penalty_tokens import PenaltyTokens
    from deepinfer.engine.structured.manager import GrammarState
    from deepinfer.engine.text.detokenizer import IncrementalDetokenizer


# Stands in output_token_ids for a token that was sampled on the device but not yet read back (overlapped
# loop only, core/overlap.py): the next step is scheduled and launched before the host knows its value.
# Scheduler.update replaces it with the real id before anything reads the token's value.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not yet admitted, or preempted and waiting to recompute
    RUNNING = "running"      # holds KV blocks and is scheduled each step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Token ids grow as tokens are sampled; the KV cache holds `num_computed_tokens`.

    Invariant: `num_computed_tokens <= len(token_ids)`. A sequence samples a new token in a step
    exactly when that step computes its last uncomputed token.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                   # the sampler's seed (given or derived; never arrival-based)
    eos_token_ids: frozenset[int] = frozenset()
    arrival: int = 0                            # FCFS order
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0                # tokens whose KV is in the cache
    num_cached_tokens: int = 0                  # prefix-cache hits at the last admission
    block_table: list[int] = field(default_factory=list)
    # Blocks of a second, per-compressed-entry pool (engine/core/window_blocks.py; DeepSeek-V4's bounded
    # layout). Empty for every other model.
    aux_block_table: list[int] = field(default_factory=list)
    # Tokens whose compressed entries that pool already holds (kept through a preemption; 0 otherwise).
    aux_valid_tokens: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs (sample 0 of a request only): entry i is written by the runner when the
    # forward computes position i - 1, entry 0 stays None. Such a sequence takes no prefix-cache hits, since
    # a cached position is never computed (scheduler._admit_waiting).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Sample i of a request with n samples; `leader` is its sample 0 (None for sample 0 itself). A sibling
    # waits until the leader's full prompt blocks are in the prefix cache, so it reuses them instead of
    # computing the same prompt again in the same step (scheduler._admit_waiting).
    sample_index: int = 0
    leader: Sequence | None = None
    # Content hashes of the full blocks of token_ids, block i at index i, memoized by the BlockManager:
    # tokens only ever grow, so a block's hash never changes, and a preempted or head-of-line-blocked
    # sequence is matched against the prefix cache again without re-hashing.
    block_hashes: list[bytes] = field(default_factory=list)
    # Incremental text, only for requests with stop strings (others are decoded once at the end).
    # Created by the OutputProcessor, fed by the finish rules, consumed by OutputProcessor.build_output.
    detokenizer: IncrementalDetokenizer | None = None
    # Grammar matcher of a constrained request. Owned by the structured-output manager: created when the
    # request is added, advanced by the finish rules, dropped when the request finishes or is aborted.
    grammar: GrammarState | None = None
    # MTP drafts for this sequence's next step (engine/spec_decode/proposer.py), guesses at the tokens after
    # its last one. The scheduler consumes them (a verify step) or drops them; never part of token_ids.
    draft_token_ids: list[int] = field(default_factory=list)
    # The distinct ids of prompt and outputs with output counts, for penalties (engine/sample/
    # penalty_tokens.py): made at the first penalised step, then grown by the new outputs only.
    penalty_tokens: PenaltyTokens | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def has_pending_token(self) -> bool:
        """True while the last output token is PENDING_TOKEN (sampled, not yet read back)."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_range(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
