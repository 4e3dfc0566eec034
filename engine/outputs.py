"""What `LLM.generate` returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given."""

    request_id: int
    prompt: str | None                 # the prompt text (None when token ids were given)
    prompt_token_ids: list[int]
    token_ids: list[int]               # generated token ids (stop string trimmed tokens included)
    text: str                          # generated text, stop string removed unless asked to keep it
    finish_reason: str                 # "stop" (EOS, stop token/string, grammar complete) or "length"
    # One dict per generated token when SamplingParams.logprobs is set: token id -> logprob, holding
    # the sampled token and the top-k alternatives (log-softmax of the raw model logits).
    logprobs: list[dict[int, float]] | None = None
    seed: int | None = None            # the seed the sampler used (given or derived)
    metrics: dict[str, float] = field(default_factory=dict)
