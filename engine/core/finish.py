"""Token-based finish rules, checked after each sampled token (text stop strings live elsewhere)."""

from __future__ import annotations

from deepinfer.engine.core.sequence import Sequence


def token_finish_reason(seq: Sequence, max_model_len: int) -> str | None:
    """Why `seq` is finished after its last sampled token, or None to keep going.

    Order: a stop token ("stop") wins over the length limits ("length"):
      * EOS (seq.eos_token_ids, unless params.ignore_eos) or params.stop_token_ids -> "stop", but only
        once more than params.min_tokens tokens were generated (the stop token itself counts, so with
        min_tokens=m the earliest stop token is output number m + 1);
      * params.max_tokens outputs -> "length";
      * seq.num_tokens reaching max_model_len -> "length".
    """
    params = seq.params
    n_out = seq.num_output_tokens
    if n_out == 0:
        return None
    last = seq.output_token_ids[-1]
    if n_out > params.min_tokens:
        if not params.ignore_eos and last in seq.eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
    if params.max_tokens is not None and n_out >= params.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None
