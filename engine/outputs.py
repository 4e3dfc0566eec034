"""What `LLM.generate` returns for each prompt (shaped like vLLM's `RequestOutput` / `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, as vLLM reports it.

    logprob: log-softmax of the raw model logits (before penalties, temperature or any filter).
    rank: 1 + the number of tokens ordered before this one by (logit descending, token id ascending), so
    rank 1 is the argmax (the greedy token; ties go to the lower id, as greedy sampling breaks them).
    decoded_token: the token decoded on its own (special tokens included, as their text).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> Logprob, the sampled (or actual) token first, then the
# top-k alternatives by rank.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's `n` completions."""

    index: int                         # sample index in [0, n); outputs[i].index == i
    text: str                          # generated text, stop string removed unless asked to keep it
    token_ids: list[int]               # generated token ids (stop string trimmed tokens included)
    finish_reason: str                 # "stop" (EOS, stop token/string, grammar complete) or "length"
    logprobs: list[PositionLogprobs] | None = None   # one dict per generated token (SamplingParams.logprobs)
    seed: int | None = None            # the seed this sample drew from (see LLM.generate on n > 1)
    cumulative_logprob: float | None = None          # sum of the sampled tokens' logprobs (when reported)
    # SamplingParams.json_schema_mode='validate': whether the text is JSON the whole schema accepts, and
    # why not when it is not (None for other requests).
    schema_valid: bool | None = None
    schema_error: str | None = None


@dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given.

    `outputs` holds the request's n completions; `text`, `token_ids`, `finish_reason`, `logprobs` and `seed`
    are those of outputs[0] (the attributes every caller of the single-sample API already reads).
    """

    request_id: int
    prompt: str | None                 # the prompt text (None when token ids were given)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def seed(self) -> int | None:
        return self.outputs[0].seed

    @property
    def finished(self) -> bool:
        """Always True: offline generate returns finished requests only (vLLM's attribute)."""
        return True
