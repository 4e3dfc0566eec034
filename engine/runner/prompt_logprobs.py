"""Prompt logprobs (SamplingParams.prompt_logprobs): logprobs of each prompt token given the tokens before it.

The engine computes logits only at sampled positions; a request asking for prompt logprobs also needs them
at every prompt position, so for that request only the forward's hidden states at its prompt positions go
through the LM head. The hidden state at position p predicts token p + 1: a prefill chunk covering positions
[start, end) yields the entries of prompt tokens start + 1 .. min(end, P - 1) (P = prompt length; position
P - 1 predicts the first output token, which the sampler reports). Entry 0 stays None.

The entries are written straight into `seq.prompt_logprobs`: they depend only on the prompt, so a chunk
recomputed after preemption writes the same values again. Such requests take no prefix-cache hits
(scheduler), so every prompt position is computed once per admission. Reading the entries back is a device
sync inside the forward launch; only steps holding such a request pay it (and they run eagerly, no graph).
"""

from __future__ import annotations

import torch
from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.sample.sampler import position_logprobs


def prompt_logprob_rows(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(flat row in the step's hidden states, scheduled index, prompt position predicted) for every
    prompt token this step predicts for a request that asks for prompt logprobs."""
    rows: list[tuple[int, int, int]] = []
    offset = 0
    for b, s in enumerate(out.scheduled):
        seq = s.seq
        if seq.prompt_logprobs is not None:
            last = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            rows.extend((offset + p - s.start, b, p + 1) for p in range(s.start, last))
        offset += s.num_new_tokens
    return rows


def record_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, out: SchedulerOutput,
                           rows: list[tuple[int, int, int]], vocab_size: int) -> None:
    """Write the prompt-logprob entries of `rows` (prompt_logprob_rows) from the step's hidden [T, H]."""
    if not rows:
        return
    index = torch.tensor([r for r, _, _ in rows], dtype=torch.int64, device=hidden.device)
    logits = model.compute_logits(hidden.index_select(0, index))[:, :vocab_size].to(torch.float32)
    targets = [out.scheduled[b].seq.prompt_token_ids[p] for _, b, p in rows]
    counts = [out.scheduled[b].seq.params.prompt_logprobs or 0 for _, b, _ in rows]
    chosen = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for (_, b, p), entry in zip(rows, position_logprobs(logits, chosen, counts), strict=True):
        table = out.scheduled[b].seq.prompt_logprobs
        if table is not None:
            table[p] = entry
