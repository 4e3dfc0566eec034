"""One speculative engine step, synchronous: schedule -> target forward -> verify -> draft pass -> update ->
draft the next step's tokens.

MTP steps do not overlap host and device work (core/overlap.py): the drafts of step N+1 depend on the
tokens step N commits, so EngineCore runs MTP steps one at a time (and hands over to the overlapped loop if
drafting turns itself off). They run eagerly (no CUDA graphs), since verify steps have several query tokens
per sequence. Outputs are byte-identical to a run without MTP in deterministic mode (verify.py says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.sequence import Sequence, SequenceStatus
from deepinfer.engine.runner.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from deepinfer.engine.spec_decode.config import MTPConfig
from deepinfer.engine.spec_decode.mtp_model import MTPDraftModel
from deepinfer.engine.spec_decode.policy import DraftPolicy, SpecStats, stats_dict
from deepinfer.engine.spec_decode.proposer import MTPProposer
from deepinfer.engine.spec_decode.v4_mtp_model import V4MTPDraftModel
from deepinfer.engine.spec_decode.verify import row_sequences, sample_and_verify

if TYPE_CHECKING:
    from deepinfer.engine.core.scheduler import Scheduler
    from deepinfer.engine.runner.model_runner import ModelRunner


class SpecDecoder:
    """Owns the draft model, its cache layer, the draft policy and the statistics of one engine."""

    def __init__(self, cfg: MTPConfig, draft: MTPDraftModel | V4MTPDraftModel, cache: Any,
                 scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.stats = SpecStats()
        self.policy = DraftPolicy(cfg, draft.target_num_layers)
        self.proposer = MTPProposer(draft, cache, scheduler.block_manager, self.policy, self.stats,
                                    runner.vocab_size, runner.device)
        self.active = True
        self.disabled_reason: str | None = None

    def disable(self, reason: str) -> None:
        """Stop drafting for the rest of this engine's life; pending drafts are dropped."""
        self.active = False
        self.disabled_reason = reason
        for seq in self.scheduler.running:
            seq.draft_token_ids = []

    def can_draft(self, seq: Sequence) -> bool:
        """Constrained requests never draft (verify.py says why)."""
        return seq.grammar is None and seq.status == SequenceStatus.RUNNING

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        sched, r = self.scheduler, self.runner
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        sampled = out.sampled
        rows = row_sequences(sampled)
        masks = r.structured.masks_for(rows) if r.structured is not None and rows else None
        batch = r.prepare(out)
        hidden = r.model(batch.input_ids, batch.positions, batch.meta, r.kv_caches)
        record_prompt_logprobs(r.model, hidden, out, prompt_logprob_rows(out), r.vocab_size)
        verified = []
        if sampled:
            logits = r.model.compute_logits(hidden[batch.sample_indices])[:, : r.vocab_size]
            verified = sample_and_verify(r.sampler, logits, sampled, masks)
        committed = {s.seq.seq_id: v.tokens for s, v in zip(sampled, verified, strict=True)}
        mtp_hidden = self.proposer.draft_pass(out, batch.meta, batch.positions, hidden, committed)
        runner_out = ModelRunnerOutput(
            seq_ids=[s.seq.seq_id for s in sampled], token_ids=[v.tokens[0] for v in verified],
            logprobs=[v.logprobs[0] for v in verified],
            spec_token_ids={s.seq.seq_id: v.tokens for s, v in zip(sampled, verified, strict=True)
                            if s.draft_token_ids},
            spec_logprobs={s.seq.seq_id: v.logprobs for s, v in zip(sampled, verified, strict=True)
                           if s.draft_token_ids})
        finished = sched.update(out, runner_out)
        self._count(verified)
        self._draft_next(out, mtp_hidden)
        if self.policy.should_disable(self.stats):
            speedup = self.policy.estimated_speedup(self.stats) or 0.0
            self.disable(f"estimated speed-up {speedup:.2f} < 1 after {self.stats.rows} rows")
        return finished

    def _count(self, verified: list) -> None:
        st = self.stats
        st.steps += 1
        st.rows += len(verified)
        for v in verified:
            st.drafted += v.num_drafted
            st.accepted += v.num_accepted
            st.verify_rows += v.num_drafted > 0

    def _draft_next(self, out: SchedulerOutput, mtp_hidden: torch.Tensor) -> None:
        """Drafts for every sampled sequence still running, from the draft-pass row of its last computed
        position (the one whose next token is the newly committed one)."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        limits: list[int] = []
        offset = 0
        for s in out.scheduled:
            seq = s.seq
            if s.sample and self.can_draft(seq):
                seqs.append(seq)
                rows.append(offset + seq.num_computed_tokens - 1 - s.start)
                limits.append(self.policy.max_drafts(self.scheduler.max_kv_tokens(seq) + 1 - seq.num_tokens))
            offset += s.num_new_tokens
        if seqs:
            index = torch.tensor(rows, dtype=torch.int64, device=mtp_hidden.device)
            self.proposer.propose(seqs, mtp_hidden[index], limits)

    def stats_dict(self) -> dict:
        return stats_dict(self.stats, self.policy, self.active, self.disabled_reason)
