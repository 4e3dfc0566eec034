"""Per-request sampling parameters (the public `SamplingParams` of DESIGN.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of a JSON Schema, a regex, a list of choices, or any JSON
    object. `SamplingParams(structured_outputs=...)` turns it into the matching `json_schema` / `regex` /
    `choice` field, so both spellings are the same request (same grammar, same derived seed)."""

    json: dict[str, Any] | bool | str | None = None   # a JSON Schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None                    # True: any JSON object
    # deepinfer's option, with `json` only: 'validate' constrains by the schema's enforceable part and
    # validates every completion against the whole schema (SamplingParams.json_schema_mode).
    json_schema_mode: str = "strict"

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self)
                 if f.name != "json_schema_mode" and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams: set exactly one of json, regex, choice, json_object (got {given})"
            )
        if self.json_schema_mode != "strict" and self.json is None:
            raise ValueError(f"StructuredOutputsParams.json_schema_mode={self.json_schema_mode!r} applies to "
                             "a JSON Schema only; set json=... or leave json_schema_mode 'strict'")

    def as_constraint(self) -> tuple[str, Any]:
        """(SamplingParams field name, value) this constraint stands for."""
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json: not valid JSON text ({e})") from None
            return "json_schema", schema
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", list(self.choice)
        return "json_schema", {"type": "object"}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction; a bad value raises ValueError naming it.

    `seed` makes sampling reproducible: the random draw for output position t depends only on
    (seed, t), never on other requests or on step order. A request without a seed gets one derived
    from the engine seed and its own content (prompt + params), never from arrival order.

    `json_schema_mode` decides what happens to a `json_schema` the grammar backend cannot fully enforce
    (e.g. `not`, `contains`, `if`/`then`): 'strict' (default) refuses the request with the backend's
    reason; 'validate' builds the grammar from the schema's enforceable part (the refused keywords
    removed, so nothing the schema accepts is excluded) and validates each finished completion against
    the whole schema with jsonschema, reporting the verdict as CompletionOutput.schema_valid and
    .schema_error (the text is returned either way; the caller decides what to do with an invalid one).
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
    # vLLM's names, added after the fields above so positional use of those keeps working:
    n: int = 1                          # completions per prompt (LLM.generate documents their seeds)
    prompt_logprobs: int | None = None  # top-k logprobs at each prompt position (the first gets None)
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    json_schema_mode: str = "strict"    # 'strict' | 'validate' (see the class docstring)

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {expected}")

        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be -1 or 0 (disabled) or an integer >= 1")
        if self.top_k == 0:
            # vLLM spells "disabled" both ways; one canonical value keeps the derived seed the same.
            object.__setattr__(self, "top_k", -1)
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
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be an integer in [0, 20] or None")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 1024:
            raise bad("n", self.n, "must be an integer in [1, 1024]")
        self._resolve_structured_outputs()
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty,
                      "must be a finite number > 0 (1.0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, getattr(self, name), "must be a number in [-2, 2]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        constraints = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(
                f"SamplingParams: at most one of json_schema, regex, choice may be set, got {constraints}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise bad("json_schema", type(self.json_schema).__name__, "must be a dict (a JSON Schema)")
        if self.json_schema_mode not in ("strict", "validate"):
            raise bad("json_schema_mode", self.json_schema_mode, "must be 'strict' or 'validate'")
        if self.json_schema_mode == "validate" and self.json_schema is None:
            raise bad("json_schema_mode", self.json_schema_mode, "applies to a json_schema constraint only; "
                      "set json_schema (or structured_outputs json) or leave it 'strict'")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", self.regex, "must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice", self.choice, "must be a non-empty list of non-empty strings")

    def _resolve_structured_outputs(self) -> None:
        """Copy `structured_outputs` into json_schema / regex / choice (refusing a second constraint)."""
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
            object.__setattr__(self, "structured_outputs", so)
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"not {type(so).__name__}")
        name, value = so.as_constraint()
        others = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if others == [name] and getattr(self, name) == value:
            return  # already copied: dataclasses.replace passes both fields back in
        if others:
            raise ValueError(f"SamplingParams: structured_outputs and {others} both set; give one constraint")
        object.__setattr__(self, name, value)
        if so.json_schema_mode != "strict":
            object.__setattr__(self, "json_schema_mode", so.json_schema_mode)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.choice is not None


# float32's largest finite value: the sampler computes in float32, where a larger value becomes inf.
_F32_MAX = 3.4028234663852886e38


def _finite(value: Any) -> bool:
    """A real number (not a bool) that stays finite in float32: inf and NaN would turn logits into NaN."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= _F32_MAX)
