"""The MTP speculative-decoding option: `LLM(speculative_mtp=...)` or `DEEPINFER_ENABLE_MTP_VARLEN=1`."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The variable DeepSeek's own inference framework reads; "1" turns MTP drafting on with the defaults.
MTP_ENV = "DEEPINFER_ENABLE_MTP_VARLEN"


@dataclass(frozen=True)
class MTPConfig:
    """How MTP drafts. Output bytes never depend on any of these fields, only speed does.

    A request drafts d_1, d_2, ... one MTP forward each, and keeps drafting while the draft's top
    probability (softmax of its logits at the request's temperature; 1.0 for greedy rows) is at least
    `confidence_threshold`, up to `max_draft_len` tokens. `auto_disable` turns drafting off for the rest of
    the run once `min_rows` drafting opportunities were measured and the estimated speed-up (policy.py) is
    below 1; `verify_token_cost` / `draft_step_cost` are that estimate's cost model (relative to one
    1-token target decode step; None = 2 / (num_hidden_layers + 2): one decoder block and one LM head).
    """

    max_draft_len: int = 3
    confidence_threshold: float = 0.6
    auto_disable: bool = True
    min_rows: int = 64
    verify_token_cost: float = 0.1
    draft_step_cost: float | None = None

    def __post_init__(self) -> None:
        if self.max_draft_len < 1:
            raise ValueError(f"MTPConfig.max_draft_len={self.max_draft_len}: must be >= 1")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"MTPConfig.confidence_threshold={self.confidence_threshold}: must be in [0, 1]")
        if self.min_rows < 1:
            raise ValueError(f"MTPConfig.min_rows={self.min_rows}: must be >= 1")
        if self.verify_token_cost < 0:
            raise ValueError(f"MTPConfig.verify_token_cost={self.verify_token_cost}: must be >= 0")
        if self.draft_step_cost is not None and self.draft_step_cost < 0:
            raise ValueError(f"MTPConfig.draft_step_cost={self.draft_step_cost}: must be >= 0 or None")


def resolve_mtp_option(option: bool | MTPConfig | None) -> MTPConfig | None:
    """The config to use, or None when MTP is off. None reads $DEEPINFER_ENABLE_MTP_VARLEN (1/true/yes/on);
    True means the defaults; False is off whatever the environment says."""
    if isinstance(option, MTPConfig):
        return option
    if option is None:
        option = os.environ.get(MTP_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not isinstance(option, bool):
        raise ValueError(f"speculative_mtp={option!r}: expected True, False, None or an MTPConfig")
    return MTPConfig() if option else None
