"""Metadata that tells attention where each new token's KV goes and which cached KV it reads."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

# Attention reduces keys/values in chunks of this many positions, aligned to absolute positions
# (chunk c covers positions [c*KV_CHUNK, (c+1)*KV_CHUNK)), in increasing order. Because the split
# never depends on the batch, the prefill/decode split or prefix-cache hits, a token's attention
# output is bitwise the same however it was scheduled. Block sizes are multiples of it.
KV_CHUNK = 16


@dataclass
class AttentionMetadata:
    """A flattened variable-length batch: B sequences, T new tokens in all (sequence-major order)."""

    slot_mapping: torch.Tensor      # int64 [T]: cache slot (block_id * block_size + offset) of each new token
    positions: torch.Tensor         # int64 [T]: absolute position of each new token in its sequence
    query_start_loc: torch.Tensor   # int32 [B+1]: new tokens of sequence b are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor          # int32 [B]: context length of each sequence after this step
    block_tables: torch.Tensor      # int32 [B, max_blocks]: KV blocks of each sequence, padded with 0
    block_size: int                 # tokens per KV block
    max_query_len: int              # longest new-token run of one sequence in this batch
    max_seq_len: int                # longest context in this batch
    # Host copies, so CPU code paths never synchronise with the device to read shapes.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # int32 [2 * B]: the paged-attention program map (b, 0) for each sequence b, given when every sequence
    # has exactly one query token (CUDA-graph decode steps keep it in a static buffer). None: the kernel
    # builds its plan from the host lengths.
    decode_plan: torch.Tensor | None = None
    # int32 [2 * P]: the program map of a CUDA-graph prefill step, in a static buffer
    # (engine/runner/prefill_inputs.py): the step's plan built for BLOCK_Q = plan_block_q, then programs that
    # store nothing. None (and whenever max_query_len == 1): the kernel builds its plan from the host lengths.
    prefill_plan: torch.Tensor | None = None
    plan_block_q: int = 0
    # With decode_plan or prefill_plan (a CUDA-graph step): whether the graph was captured for rows long
    # enough to split their keys (kernels/paged_attention.py, SPLIT_FROM): a decode step's static split
    # launches, a prefill step's programs that merge their rows' ranges (MERGE_IN_PLACE tiles only).
    split_kv: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def static_decode(self) -> bool:
        """A decode step with a static program map (`decode_plan`): its host lengths may be placeholders."""
        return self.decode_plan is not None and self.max_query_len == 1

    @property
    def static_prefill(self) -> bool:
        """A CUDA-graph prefill step with its static program map (`prefill_plan`)."""
        return self.prefill_plan is not None and self.max_query_len > 1

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def plan_cached_on(meta: AttentionMetadata, attr: str, key: Hashable,
                   build: Callable[[list[int], list[int]], T]) -> T:
    """`build(query_lens_cpu, seq_lens_cpu)`, cached on `meta` under `attr` and `key` (one build per step,
    not per layer). A cached plan is reused only while meta's host-side lengths are unchanged, so a
    metadata object refilled in place for the next step gets a fresh plan."""
    lens = (list(meta.query_lens_cpu), list(meta.seq_lens_cpu))
    cache = getattr(meta, attr, None)
    if cache is not None and key in cache and cache[key][0] == lens:
        return cache[key][1]
    built = build(*lens)
    try:
        if cache is None:
            cache = {}
            setattr(meta, attr, cache)
        cache[key] = (lens, built)
    except AttributeError:  # a frozen/slotted metadata class: rebuild per call instead
        pass
    return built
