"""Draft-length policy, acceptance statistics, and the rule that turns MTP off when it does not pay.

Draft length per request and step: keep drafting while the draft's top probability is >= the threshold, up
to `max_draft_len`, and never past the request's own end: with r output tokens still allowed (max_tokens,
max_model_len), at most r - 1 drafts, since the verify step also commits the target's own token.

Auto-off: each speculative step's sampled rows (R, summed over steps S) commit R + A tokens, A the accepted
drafts. Relative to plain decoding, where a step of R rows costs 1 and commits R tokens, the estimate is

    speed-up = (1 + A / R) / (1 + verify_token_cost * D / R + draft_step_cost * F / S)

with D the drafted tokens and F the MTP forwards (one draft pass per step plus one per chained draft
depth). Once R >= min_rows and the estimate is below 1, drafting stops for the rest of the run (outputs
are the same either way). The costs are a model, to be set from benchmarks/bench_mtp.py's measured
verify-step cost; short outputs can lose because the draft pass runs on prefill steps too.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.spec_decode.config import MTPConfig


@dataclass
class SpecStats:
    """Cumulative counters of the speculative steps (LLM.get_stats)."""

    steps: int = 0             # engine steps run speculatively
    rows: int = 0              # sampled rows of those steps (one per sequence that sampled)
    verify_rows: int = 0       # rows that verified at least one draft
    drafted: int = 0           # draft tokens verified
    accepted: int = 0          # draft tokens accepted (equal to what the target sampled there)
    draft_forwards: int = 0    # MTP forwards: draft passes and chained draft steps


class DraftPolicy:
    """How long each request drafts, and whether drafting still pays for the run."""

    def __init__(self, cfg: MTPConfig, num_hidden_layers: int) -> None:
        self.cfg = cfg
        self.draft_step_cost = (cfg.draft_step_cost if cfg.draft_step_cost is not None
                                else 2.0 / (num_hidden_layers + 2))

    def max_drafts(self, num_outputs_left: int) -> int:
        """Drafts a request may make when it may still produce `num_outputs_left` tokens."""
        return max(0, min(self.cfg.max_draft_len, num_outputs_left - 1))

    def keep_drafting(self, confidence: float) -> bool:
        return confidence >= self.cfg.confidence_threshold

    def estimated_speedup(self, st: SpecStats) -> float | None:
        """The module docstring's estimate; None before anything was measured."""
        if st.rows == 0 or st.steps == 0:
            return None
        cost = 1.0 + self.cfg.verify_token_cost * st.drafted / st.rows + (
            self.draft_step_cost * st.draft_forwards / st.steps)
        return (1.0 + st.accepted / st.rows) / cost

    def should_disable(self, st: SpecStats) -> bool:
        if not self.cfg.auto_disable or st.rows < self.cfg.min_rows:
            return False
        speedup = self.estimated_speedup(st)
        return speedup is not None and speedup < 1.0


def stats_dict(st: SpecStats, policy: DraftPolicy | None, active: bool, disabled_reason: str | None
               ) -> dict[str, float | int | bool | str | None]:
    """The spec_* entries of LLM.get_stats()."""
    speedup = policy.estimated_speedup(st) if policy is not None else None
    return {
        "spec_enabled": policy is not None,
        "spec_active": active,
        "spec_disabled_reason": disabled_reason,
        "spec_steps": st.steps,
        "spec_verify_steps": st.verify_rows,
        "spec_drafted_tokens": st.drafted,
        "spec_accepted_tokens": st.accepted,
        "spec_acceptance_rate": st.accepted / st.drafted if st.drafted else 0.0,
        # Per verify step of one request: accepted drafts, and tokens committed (accepted + the target's own).
        "spec_mean_accepted_tokens_per_step": st.accepted / st.verify_rows if st.verify_rows else 0.0,
        "spec_mean_tokens_per_verify_step": 1.0 + st.accepted / st.verify_rows if st.verify_rows else 0.0,
        "spec_draft_forwards": st.draft_forwards,
        "spec_estimated_speedup": speedup if speedup is not None else 0.0,
    }
