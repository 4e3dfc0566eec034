"""Per-request sampling parameters (the public `SamplingParams` of DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction; a bad value raises ValueError naming it.

    `seed` makes sampling reproducible: the random draw for output position t depends only on
    (seed, t), never on other requests or on step order. A request without a seed gets one derived
    from the engine seed and its own content (prompt + params), never from arrival order.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {expected}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "must be an integer or None")
        if self.stop is not None:
            if isinstance(self.stop, str):
                object.__setattr__(self, "stop", [self.stop])
            if not all(isinstance(s, str) and s for s in self.stop):
                raise bad("stop", self.stop, "must be a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "must be an integer in [0, 20] or None")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1.0 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        constraints = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(
                f"SamplingParams: at most one of json_schema, regex, choice may be set, got {constraints}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise bad("json_schema", type(self.json_schema).__name__, "must be a dict (a JSON Schema)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", self.regex, "must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice", self.choice, "must be a non-empty list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.choice is not None
