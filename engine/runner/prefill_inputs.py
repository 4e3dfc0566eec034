"""Inputs of a CUDA-graph prefill step: token buckets, the padded step, static device buffers.

A prefill (or mixed) step of a small model is host-bound: ~10 launches per layer, each costing more host time
than its GPU work. A graph captured per token bucket replays them in one launch; the step's inputs are
padded to the bucket's token count and a fixed number of sequences (the scheduler's max_num_seqs, S):

- sequences 0..B-1 are the step's own, in batch order (their flattened tokens first, as in an eager step);
- sequences B..S-1 are empty (no new token, context 1): no attention program runs for them;
- sequence S (the padding sequence) holds the bucket's T_bucket - T padding tokens: token 0 at position 0,
  cache slot -1 (nothing is stored), context 1, a block table of zeros. Each attends to position 0 of block
  0 only (a valid block; what it reads reaches only the padding rows), so padding costs one key tile per
  query block instead of a prompt's worth of attention.

The attention plan (kernels/attention_plan.build_plan) covers sequences 0..S, and is filled up to a fixed
capacity (`plan_capacity`) with programs that store nothing (the padding sequence at a query block past its
tokens): the kernel's grid is fixed per bucket. Capacity: a sequence of q tokens has ceil(q / BLOCK_Q) <=
q / BLOCK_Q + 1 query blocks, so all of them, the padding sequence's included, fit ceil(T_bucket / BLOCK_Q)
+ S + 1 programs.

Why a real row's bits equal an eager step's: every op of the dense decoder is row-independent in
deterministic mode (GEMM tiles never depend on M, RMSNorm per row, rotary per token), and attention runs
the same (sequence, query block) programs with the same tile config as the eager step's host plan (only
their order differs, which never changes a result). Fast mode computes a padded step as an eager step of
the bucket's size would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from deepinfer.engine.runner.host_step import HostStep, query_start_loc
from deepinfer.engine.runner.input_buffers import PAD_BLOCK, PAD_POSITION, PAD_SEQ_LEN, PAD_SLOT, PAD_TOKEN_ID
from deepinfer.engine.runner.static_image import StaticImage
from deepinfer.kernels.attention_plan import build_plan
from deepinfer.kernels.metadata import AttentionMetadata


def prefill_buckets(max_tokens: int, first: int = 256, step: int = 2048) -> list[int]:
    """Token counts to capture, ascending: first, 2 * first, ... while below `step`, then multiples of
    `step`, ending exactly at max_tokens (the scheduler's token budget: no step needs more)."""
    if max_tokens < 1 or first < 1 or step < 1:
        raise ValueError(f"max_tokens={max_tokens}, first={first}, step={step}: must be >= 1")
    small = []
    b = first
    while b < min(step, max_tokens):
        small.append(b)
        b *= 2
    return sorted(set(small + list(range(step, max_tokens, step)) + [max_tokens]))


def plan_capacity(tokens: int, max_seqs: int, block_q: int) -> int:
    """Programs of a bucket of `tokens` tokens (module docstring)."""
    return -(-tokens // block_q) + max_seqs + 1


@dataclass
class PaddedPrefill:
    """One prefill step padded to `bucket` tokens and max_seqs + 1 sequences (module docstring)."""

    num_tokens: int              # the step's own tokens (rows >= num_tokens are padding)
    bucket: int
    input_ids: np.ndarray        # int64 [bucket]
    positions: np.ndarray        # int64 [bucket]
    slot_mapping: np.ndarray     # int64 [bucket]
    query_start_loc: np.ndarray  # int32 [max_seqs + 2]: the cumulative query_lens
    block_tables: np.ndarray     # int32 [B, width]: the step's own sequences' tables only
    plan: np.ndarray | None      # int32 [2 * plan_capacity]; None without a block_q (CPU: no kernel plan)
    query_lens: list[int]        # [max_seqs + 1]: new tokens per sequence
    seq_lens: list[int]          # [max_seqs + 1]: context length per sequence after the step


def pad_prefill(step: HostStep, bucket: int, max_seqs: int, block_q: int | None) -> PaddedPrefill:
    """The padded inputs of `step` in a bucket of `bucket` tokens (module docstring)."""
    t, b = step.num_tokens, len(step.query_lens)
    if not 0 < t <= bucket:
        raise ValueError(f"a step of {t} tokens does not fit a bucket of {bucket}")
    if b > max_seqs:
        raise ValueError(f"a step of {b} sequences exceeds max_seqs={max_seqs}")
    pad = bucket - t
    ids = np.full(bucket, PAD_TOKEN_ID, dtype=np.int64)
    pos = np.full(bucket, PAD_POSITION, dtype=np.int64)
    slots = np.full(bucket, PAD_SLOT, dtype=np.int64)
    ids[:t], pos[:t], slots[:t] = step.input_ids, step.positions, step.slot_mapping
    query_lens = step.query_lens + [0] * (max_seqs - b) + [pad]
    seq_lens = step.seq_lens + [PAD_SEQ_LEN] * (max_seqs - b + 1)
    plan = None
    if block_q is not None:
        cap = plan_capacity(bucket, max_seqs, block_q)
        plan = np.empty(2 * cap, dtype=np.int32)
        real = build_plan(query_lens, seq_lens, block_q)
        plan[: real.shape[0]] = real
        # Programs past the plan: the padding sequence at a query block past all its tokens (stores nothing).
        plan[real.shape[0]::2] = max_seqs
        plan[real.shape[0] + 1::2] = -(-bucket // block_q) + 1
    return PaddedPrefill(t, bucket, ids, pos, slots, query_start_loc(query_lens), step.block_tables, plan,
                         query_lens, seq_lens)


class StaticPrefillBuffers:
    """Device buffers a captured prefill graph reads (views of one StaticImage); `load` copies a padded step
    into them. Row max_seqs of the block tables (the padding sequence's) is never written: always zeros.
    Columns and rows a step does not write keep earlier steps' values (valid block ids, never read: attention
    stops at each row's own position, and empty sequences run no program)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_q: int | None,
                 device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.block_q = max_tokens, max_seqs, block_q
        t, s, w = max_tokens, max_seqs, max_blocks_per_seq
        cap = plan_capacity(t, s, block_q) if block_q is not None else 1
        self._image = StaticImage([
            ("input_ids", (t,), np.int64), ("positions", (t,), np.int64), ("slot_mapping", (t,), np.int64),
            ("query_start_loc", (s + 2,), np.int32), ("seq_lens", (s + 1,), np.int32),
            ("block_tables", (s + 1, w), np.int32), ("plan", (2 * cap,), np.int32)], device)
        self._image.host["block_tables"][:] = PAD_BLOCK
        dev = self._image.device
        names = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "plan")
        (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
         self.block_tables, self.plan) = (dev[k] for k in names)
        self.last: PaddedPrefill | None = None   # the step loaded last (its host lengths: CPU stand-ins)

    def load(self, step: PaddedPrefill) -> None:
        """Copy `step` into the buffers (asynchronously, from pinned staging on CUDA)."""
        h = self._image.host
        b, width = step.block_tables.shape
        if step.bucket > self.max_tokens or width > h["block_tables"].shape[1]:
            raise ValueError(f"step of {step.bucket} tokens x {width} blocks exceeds the buffers "
                             f"({self.max_tokens} x {h['block_tables'].shape[1]})")
        n = step.bucket
        h["input_ids"][:n], h["positions"][:n], h["slot_mapping"][:n] = (
            step.input_ids, step.positions, step.slot_mapping)
        h["query_start_loc"][:] = step.query_start_loc
        h["seq_lens"][:] = step.seq_lens
        h["block_tables"][:b, :width] = step.block_tables
        parts = {"input_ids": n, "positions": n, "slot_mapping": n, "query_start_loc": self.max_seqs + 2,
                 "seq_lens": self.max_seqs + 1, "block_tables": b}
        if step.plan is not None:
            h["plan"][: step.plan.shape[0]] = step.plan
            parts["plan"] = step.plan.shape[0]
        self._image.upload(parts)   # what this step reads and wrote: prefixes of the token and table buffers
        self.last = step


def prefill_graph_metadata(buf: StaticPrefillBuffers, bucket: int, block_size: int,
                           live: bool = False, split_kv: bool = False) -> AttentionMetadata:
    """The metadata a prefill graph of `bucket` tokens is captured with: views of the static buffers.

    Its host lengths are placeholders (live=False: the padding sequence holds every token), valid for the
    argument checks only: the CUDA kernels read the device tensors and the static plan. live=True takes
    the host lengths of the step loaded last instead, for ops that read them (the CPU ops: stand-ins).
    split_kv: the graph serves steps with rows past paged attention's split threshold (its programs merge
    their rows' ranges: kernels/paged_attention.py)."""
    s = buf.max_seqs
    if live and buf.last is not None:
        query_lens, seq_lens = list(buf.last.query_lens), list(buf.last.seq_lens)
    else:
        query_lens, seq_lens = [0] * s + [bucket], [PAD_SEQ_LEN] * (s + 1)
    plan = None
    if buf.block_q is not None:
        plan = buf.plan[: 2 * plan_capacity(bucket, s, buf.block_q)]
    return AttentionMetadata(
        slot_mapping=buf.slot_mapping[:bucket], positions=buf.positions[:bucket],
        query_start_loc=buf.query_start_loc, seq_lens=buf.seq_lens, block_tables=buf.block_tables,
        block_size=block_size, max_query_len=max(2, max(query_lens)),
        max_seq_len=buf.block_tables.shape[1] * block_size, query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens, prefill_plan=plan, plan_block_q=buf.block_q or 0, split_kv=split_kv,
    )
