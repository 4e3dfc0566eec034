"""Finish rules: after each sampled token, whether a request is done and why. The only place this is decided.

Checked by `Scheduler.update` once the token is appended, in this order of precedence:
  1. text rules -> "stop": the request's detokenizer matched a stop string with this token, or its grammar
     is complete (the grammar cannot continue, accepted EOS, or went into error). min_tokens does not
     apply to these, only to stop tokens.
  2. a stop token -> "stop": EOS (seq.eos_token_ids, unless params.ignore_eos) or one of
     params.stop_token_ids, but only once more than params.min_tokens tokens were generated (the stop
     token itself counts, so with min_tokens=m the earliest stop token is output number m + 1);
  3. params.max_tokens outputs -> "length";
  4. seq.num_tokens reaching max_model_len -> "length".
So a stop string or a completed grammar on the last allowed token still reports "stop".
"""

from __future__ import annotations

import operator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
from deepinfer.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from deepinfer.engine.sample.params import SamplingParams
    from deepinfer.engine.structured.lazy import LazyStructuredOutputs


@dataclass(frozen=True)
class Finish:
    """The verdict on a request after its last sampled token."""

    # The request's finish_reason: "stop" or "length".
    reason: str
    # True when a token rule (stop token, max_tokens, max_model_len) fired, even if a text rule gives the
    # reason; False when only a text rule ended the request. Scheduler.update releases the two groups'
    # KV blocks at different points of the step (it says why).
    by_token_rule: bool


def token_finish_reason(seq: Sequence, max_model_len: int) -> str | None:
    """Rules 2-4 of the module docstring: the finish reason from token ids and lengths alone, or None."""
    params = seq.params
    outs = seq.output_token_ids
    n_out = len(outs)
    if n_out == 0:
        return None
    if n_out > params.min_tokens:
        last = outs[-1]
        if not params.ignore_eos and last in seq.eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
    if params.max_tokens is not None and n_out >= params.max_tokens:
        return "length"
    if len(seq.prompt_token_ids) + n_out >= max_model_len:
        return "length"
    return None


def token_rule_rows(seqs: SequenceABC[Sequence], max_model_len: int) -> list[int]:
    """Rows i (ascending) where `token_finish_reason(seqs[i], max_model_len)` may not be None: a superset of
    them, computed for the whole batch at once with numpy, so that the per-row rules run only on these.

    A row is kept when its last output token is any stop id or EOS id of the batch (min_tokens is left to
    the exact rules), or its length reaches its max_tokens or max_model_len. Every row must hold at least
    one output token (a sampled step's rows do)."""
    n = len(seqs)
    if n == 0:
        return []
    outs = [q.output_token_ids for q in seqs]
    n_out = np.fromiter(map(len, outs), dtype=np.int64, count=n)
    n_tok = n_out + np.fromiter((len(q.prompt_token_ids) for q in seqs), dtype=np.int64, count=n)
    flag = n_tok >= max_model_len
    params = [q.params for q in seqs]
    p0 = params[0]
    if all(map(operator.is_, params, repeat(p0))):   # one SamplingParams for the batch (LLM.generate)
        distinct = [p0]
        if p0.max_tokens is not None:
            flag |= n_out >= p0.max_tokens
    else:
        distinct = list({id(p): p for p in params}.values())
        caps = [p.max_tokens for p in params]
        if caps.count(None) != n:
            big = np.iinfo(np.int64).max
            flag |= n_out >= np.fromiter((big if c is None else c for c in caps), dtype=np.int64, count=n)
    stop_ids: set[int] = set()
    for p in distinct:
        stop_ids.update(p.stop_token_ids or ())
    if not all(p.ignore_eos for p in distinct):
        eos = [q.eos_token_ids for q in seqs]
        e0 = eos[0]
        for e in ([e0] if all(map(operator.is_, eos, repeat(e0))) else {id(e): e for e in eos}.values()):
            stop_ids.update(e)
    if stop_ids:
        last = np.fromiter((o[-1] for o in outs), dtype=np.int64, count=n)
        flag |= np.isin(last, np.fromiter(stop_ids, dtype=np.int64, count=len(stop_ids)))
    return np.flatnonzero(flag).tolist()


def token_rule_filter(params: SamplingParams, max_model_len: int) -> tuple[frozenset[int], bool, int, int]:
    """For a batch sharing `params`: (stop ids, whether EOS ids stop, output cap, max_model_len). A row may
    end by a token rule only when its last token is in the stop ids (or its EOS ids, when they stop) or its
    output count reaches the cap or its length max_model_len; `token_rule_rows` in one loop."""
    cap = params.max_tokens if params.max_tokens is not None else max_model_len
    return frozenset(params.stop_token_ids or ()), not params.ignore_eos, cap, max_model_len


def _advances_grammar_rows_only(structured: object) -> bool:
    # Imported here: only an engine with a structured handle needs it.
    from deepinfer.engine.structured.lazy import LazyStructuredOutputs

    return type(structured) is LazyStructuredOutputs


class FinishRules:
    """Applies the finish rules to a request's newly sampled token.

    It is also where the token reaches the request's text and grammar state (detokenizer, matcher), since
    the text rules read them: every sampled token is fed to both, the last one included, because the
    detokenizer's text is the output and a grammar completed on the last token changes the reason.
    """

    def __init__(self, max_model_len: int, structured: LazyStructuredOutputs | None = None) -> None:
        self.max_model_len = max_model_len
        self.structured = structured
        # Whether `structured.advance` does nothing for a request without grammar state (the engine's
        # handle, structured/lazy.py); any other advance is fed every row (rows_to_check).
        self.grammar_rows_only = structured is None or _advances_grammar_rows_only(structured)

    def rows_to_check(self, seqs: SequenceABC[Sequence]) -> list[int]:
        """Rows i (ascending) of a step whose `check(seqs[i])` may give a verdict or feed text or grammar
        state: those the token rules may end (`token_rule_rows`) and those with a detokenizer or a grammar.
        `check` of any other row returns None and changes nothing, so a step may skip it."""
        n = len(seqs)
        if not self.grammar_rows_only:
            return list(range(n))
        rows = token_rule_rows(seqs, self.max_model_len)
        detoks = [q.detokenizer for q in seqs]
        grammars = [q.grammar for q in seqs]
        if detoks.count(None) != n or grammars.count(None) != n:
            # Text and grammar state is fed every token: those rows are checked every step.
            rows = sorted({*rows, *(i for i in range(n) if detoks[i] is not None or grammars[i] is not None)})
        return rows

    def check(self, seq: Sequence) -> Finish | None:
        """Feed seq's last output token to its detokenizer and grammar, then apply the rules."""
        token = seq.output_token_ids[-1]
        grammar_complete = self.structured is not None and self.structured.advance(seq, token)
        stop_string = False
        detok = seq.detokenizer
        if detok is not None:
            detok.add_token(token)
            stop_string = detok.stopped
        by_tokens = token_finish_reason(seq, self.max_model_len)
        if grammar_complete or stop_string:
            return Finish("stop", by_token_rule=by_tokens is not None)
        if by_tokens is not None:
            return Finish(by_tokens, by_token_rule=True)
        return None
