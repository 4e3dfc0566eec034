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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.engine.core.sequence import Sequence

if TYPE_CHECKING:
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


class FinishRules:
    """Applies the finish rules to a request's newly sampled token.

    It is also where the token reaches the request's text and grammar state (detokenizer, matcher), since
    the text rules read them: every sampled token is fed to both, the last one included, because the
    detokenizer's text is the output and a grammar completed on the last token changes the reason.
    """

    def __init__(self, max_model_len: int, structured: LazyStructuredOutputs | None = None) -> None:
        self.max_model_len = max_model_len
        self.structured = structured

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
