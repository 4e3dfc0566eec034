"""The MTP passes of a speculative step: the draft pass over the step's rows, then chained drafting.

Draft pass: the MTP layer runs over exactly the rows the target just computed, with the target's metadata
(same slots, positions, block tables): row p gets the target's hidden state h_p and the token at p + 1 (the
next prompt token, an accepted draft, or the newly committed token), and writes its latent at p's slot in
the MTP layer's cache. Rows whose next token is not committed (rejected drafts) write slots past the
sequence's computed tokens, which are written again before anything reads them.

Chained drafting, per sequence that may draft: d_1 comes from the draft-pass row of the last computed
position; d_{j+1} from one more MTP step at the position after, fed the previous step's output and d_j.
Each draft is drawn by the engine's own sampler with the noise the target will use at that output position
(same seed and position, penalties over outputs + drafts so far), so a draft that models the target well
agrees with it also at temperature > 0. Chained steps write MTP latents past the computed tokens, into
slots reserved for the verify step (`BlockManager.append_slots`); without a free block, drafting stops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.penalty_tokens import sequence_entries
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.engine.spec_decode.mtp_model import MTPDraftModel
from deepinfer.engine.spec_decode.policy import DraftPolicy, SpecStats
from deepinfer.engine.spec_decode.v4_mtp_model import V4MTPDraftModel
from deepinfer.kernels.metadata import AttentionMetadata


def shifted_inputs(out: SchedulerOutput, committed: dict[int, list[int]]) -> list[int]:
    """Per row of the step, the token after the row's position (0 where none is committed)."""
    ids: list[int] = []
    for s in out.scheduled:
        seq = s.seq
        n_before = seq.num_tokens
        new = committed.get(seq.seq_id, [])
        for p in range(s.start + 1, s.start + s.num_new_tokens + 1):
            if p < n_before:
                ids.append(seq.token_at(p))
            else:
                i = p - n_before
                ids.append(new[i] if i < len(new) else 0)
    return ids


def single_token_meta(seqs: list[Sequence], positions: list[int], block_size: int, device: torch.device
                      ) -> AttentionMetadata:
    """Metadata of a step computing one token per sequence at `positions` (slots must be allocated)."""
    bs = block_size
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    slots = []
    for b, (seq, p) in enumerate(zip(seqs, positions, strict=True)):
        tables[b, : len(seq.block_table)] = seq.block_table
        slots.append(seq.block_table[p // bs] * bs + p % bs)
    seq_lens = [p + 1 for p in positions]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return AttentionMetadata(
        slot_mapping=dev(np.asarray(slots, dtype=np.int64)),
        positions=dev(np.asarray(positions, dtype=np.int64)),
        query_start_loc=dev(np.arange(len(seqs) + 1, dtype=np.int32)),
        seq_lens=dev(np.asarray(seq_lens, dtype=np.int32)),
        block_tables=dev(tables), block_size=bs, max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seqs), seq_lens_cpu=seq_lens,
    )


class MTPProposer:
    """Runs the draft model over its own cache layer and sets `seq.draft_token_ids`."""

    def __init__(self, draft: MTPDraftModel | V4MTPDraftModel, cache: Any, block_manager: BlockManager,
                 policy: DraftPolicy, stats: SpecStats, vocab_size: int, device: torch.device) -> None:
        self.draft = draft
        self.cache = cache
        self.block_manager = block_manager
        self.policy = policy
        self.stats = stats
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def draft_pass(self, out: SchedulerOutput, meta: AttentionMetadata, positions: torch.Tensor,
                   target_hidden: torch.Tensor, committed: dict[int, list[int]]) -> torch.Tensor:
        """The MTP layer over the step's rows (module docstring); its outputs [T, H]. Call before the
        scheduler appends `committed` (seq_id -> tokens the step commits)."""
        ids = torch.tensor(shifted_inputs(out, committed), dtype=torch.int64).to(self.device)
        self.stats.draft_forwards += 1
        features = self.draft.target_features(target_hidden)   # V3: the hidden states; V4: the streams
        return self.draft(ids, positions, features, meta, self.cache)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], hidden: torch.Tensor, limits: list[int]) -> None:
        """Draft for `seqs` (running, just committed a token) from the draft-pass rows `hidden` [len, H] of
        their last computed positions; at most limits[i] drafts each."""
        active = [i for i, lim in enumerate(limits) if lim > 0]
        if not active:
            return
        group_hidden = hidden[torch.tensor(active, dtype=torch.int64, device=hidden.device)]
        depth = 0
        while active:
            group = [seqs[i] for i in active]
            tokens, conf = self._draw(group, group_hidden, depth)
            keep: list[int] = []
            for row, (i, tok, c) in enumerate(zip(active, tokens, conf, strict=True)):
                if not self.policy.keep_drafting(c):
                    continue
                seqs[i].draft_token_ids.append(tok)
                if len(seqs[i].draft_token_ids) < limits[i]:
                    keep.append(row)
            depth += 1
            # Chained step: one MTP token per sequence, at the position after its last draft's context.
            chain = [r for r in keep if self.block_manager.append_slots(group[r], depth)]
            if not chain:
                return
            cseqs = [group[r] for r in chain]
            pos = [s.num_computed_tokens + depth - 1 for s in cseqs]
            meta = single_token_meta(cseqs, pos, self.block_manager.block_size, self.device)
            ids = torch.tensor([s.draft_token_ids[-1] for s in cseqs], dtype=torch.int64).to(self.device)
            prev = group_hidden[torch.tensor(chain, dtype=torch.int64, device=group_hidden.device)]
            self.stats.draft_forwards += 1
            group_hidden = self.draft(ids, meta.positions, prev, meta, self.cache)
            active = [active[r] for r in chain]

    def _draw(self, seqs: list[Sequence], hidden: torch.Tensor, depth: int) -> tuple[list[int], list[float]]:
        """Each sequence's next draft, drawn with the target's noise for that output position, and the
        draft's top probability at the request's temperature (1 for greedy requests)."""
        logits = self.draft.compute_logits(hidden)[:, : self.vocab_size]
        meta = SamplingMetadata.from_params(
            [s.params for s in seqs], [s.seed for s in seqs],
            [s.num_output_tokens + depth for s in seqs], self.vocab_size, self.device,
            eos_token_ids=[s.eos_token_ids for s in seqs],
            # Penalties count the drafts so far as outputs (a copy of the sequence's kept table).
            penalty_entries=lambda i: sequence_entries(seqs[i], self.vocab_size, seqs[i].draft_token_ids))
        meta = dataclasses.replace(meta, num_logprobs=[None] * len(seqs))
        tokens = self.sampler(logits, meta).token_ids.tolist()
        temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
                             dtype=torch.float32, device=logits.device)
        conf = torch.softmax(logits / temps.unsqueeze(1), dim=-1).amax(dim=-1).tolist()
        return tokens, conf
