"""choice_loglikelihood: each option's log-likelihood given the prompt, from the engine's prompt logprobs.

The split follows lm-evaluation-harness's loglikelihood requests: trailing whitespace of the context
moves to the start of the continuation; `context + continuation` is encoded as a whole and the context
alone; the continuation's tokens are the whole encoding past the context's length (so a merge across the
boundary is attributed to the continuation), and the request is context tokens + continuation tokens.
Its log-likelihood is the sum over continuation positions of log P(token | everything before it), read
from `RequestOutput.prompt_logprobs` (the public engine API; the entry of a prompt token is its own
logprob, whatever k is). One extra engine request per option (max_tokens=1, greedy, prompt_logprobs=0):
its generated token is discarded, and the prefix cache shares the context's blocks across options.
"""

from __future__ import annotations

from typing import Any


def split_pair(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's _encode_pair text split: the context's trailing whitespace goes to the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    return context, continuation


def option_requests(tokenizer: Any, context: str, options: list[str], add_special_tokens: bool
                    ) -> tuple[list[list[int]], list[int]] | str:
    """(token ids per option, index where each option's tokens start), or the reason it cannot be scored."""
    pairs = [split_pair(context, o) for o in options]
    texts = [c for c, _ in pairs[:1]] + [c + o for c, o in pairs]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    ctx = encoded[0]
    if not ctx:
        return "the prompt encodes to zero tokens, so no option token has a context to be predicted from"
    ids, starts = [], []
    for i, whole in enumerate(encoded[1:]):
        cont = whole[len(ctx):]
        if not cont:
            return f"option {i} adds no tokens to the prompt"
        ids.append(list(ctx) + list(cont))
        starts.append(len(ctx))
    return ids, starts


def option_loglikelihood(prompt_logprobs: list[Any], ids: list[int], start: int) -> float:
    """Sum of the logprobs of ids[start:] at their positions (each entry maps token id -> Logprob)."""
    total = 0.0
    for pos in range(start, len(ids)):
        total += float(prompt_logprobs[pos][ids[pos]].logprob)
    return total
