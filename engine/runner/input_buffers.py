"""Inputs of a CUDA-graph decode step: batch-size buckets, padded host arrays, static device buffers.

A captured graph replays fixed kernels on fixed addresses, so a decode step of n sequences runs the graph of
the smallest bucket B >= n with its inputs copied into static buffers and rows n..B-1 filled with padding:
token 0 at position 0, cache slot -1 (store_kv skips negative slots, so padding never writes the cache),
context length 1 and a block table of zeros (attention reads position 0 of block 0, a valid block whose
contents only reach the padding row's own output). Every batch-invariant op treats rows independently, so
padding never changes a real row's bits.

The functions here are pure (numpy in, numpy out) so that the bucket and padding rules are tested on CPU;
`DecodeStager` builds the same arrays as `pad_decode` incrementally across steps (host time per decode step).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress

import numpy as np
import torch
from deepinfer.engine.runner.static_image import StaticImage
from deepinfer.kernels.metadata import AttentionMetadata

# Buckets grow by this step past the powers of two below it: at most STEP - 1 padding rows per step.
BUCKET_STEP = 16
# Padding values (see the module docstring).
PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 1
PAD_BLOCK = 0


def graph_buckets(max_num_seqs: int, max_graph_batch: int = 256) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then multiples of BUCKET_STEP, ending exactly at
    min(max_num_seqs, max_graph_batch) so the largest decode batch the scheduler can form needs no more."""
    if max_num_seqs < 1 or max_graph_batch < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}, max_graph_batch={max_graph_batch}: must be >= 1")
    top = min(max_num_seqs, max_graph_batch)
    small = [b for b in (1, 2, 4, 8) if b < top]
    steps = list(range(BUCKET_STEP, top, BUCKET_STEP))
    return sorted(set(small + steps + [top]))


def pick_bucket(buckets: Sequence[int], num_seqs: int) -> int | None:
    """The smallest bucket holding `num_seqs` rows (buckets ascending), or None when none does."""
    if num_seqs < 1:
        return None
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


@dataclass(frozen=True)
class DecodeRow:
    """One real sequence of a decode step (it computes exactly one token)."""

    token_id: int              # the input token (PENDING_TOKEN when it is read from the previous step)
    position: int              # its absolute position
    block_table: list[int]     # the sequence's KV blocks (covers `position`)


@dataclass
class PaddedDecode:
    """Host arrays of one padded decode step of `bucket` rows; rows >= num_real are padding."""

    num_real: int
    bucket: int
    input_ids: np.ndarray      # int64 [bucket]
    positions: np.ndarray      # int64 [bucket]
    slot_mapping: np.ndarray   # int64 [bucket]: PAD_SLOT on padding rows
    seq_lens: np.ndarray       # int32 [bucket]: position + 1; PAD_SEQ_LEN on padding rows
    block_tables: np.ndarray   # int32 [bucket, width]: each table padded with PAD_BLOCK


def pad_decode(rows: Sequence[DecodeRow], bucket: int, block_size: int) -> PaddedDecode:
    """The padded inputs of a decode step; `width` = the longest block table (at least 1)."""
    n = len(rows)
    if not 0 < n <= bucket:
        raise ValueError(f"{n} rows do not fit a bucket of {bucket}")
    width = max(1, max(len(r.block_table) for r in rows))
    ids = np.full(bucket, PAD_TOKEN_ID, dtype=np.int64)
    pos = np.full(bucket, PAD_POSITION, dtype=np.int64)
    slots = np.full(bucket, PAD_SLOT, dtype=np.int64)
    lens = np.full(bucket, PAD_SEQ_LEN, dtype=np.int32)
    tables = np.full((bucket, width), PAD_BLOCK, dtype=np.int32)
    for b, r in enumerate(rows):
        block = r.position // block_size
        if block >= len(r.block_table):
            raise ValueError(f"row {b}: position {r.position} is past its {len(r.block_table)} blocks")
        ids[b] = r.token_id
        pos[b] = r.position
        slots[b] = r.block_table[block] * block_size + r.position % block_size
        lens[b] = r.position + 1
        tables[b, : len(r.block_table)] = r.block_table
    return PaddedDecode(n, bucket, ids, pos, slots, lens, tables)


class DecodeStager:
    """`pad_decode`'s result built incrementally: the padded block-table array persists across steps and a
    batch row is rewritten only when its table differs from the one it held in the last step.

    In steady decoding the same sequence sits at the same row step after step and its table grows by one
    block every block_size steps, so a step costs one compare of all tables (C-level) plus a numpy write
    for each row whose table changed. Tables are
    compared by value against a copy kept per row, not by list identity, so any edit of a block table
    (appends, a new table after preemption, core/window_blocks.py releasing entries in place) is seen.

    Invariant: row b of `tables` holds `held[b]` followed by PAD_BLOCK; rows past the step are cleared when a
    step uses them as padding, so every step's arrays equal pad_decode's (tests/engine/test_decode_stager.py).
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.tables = np.full((max_batch, max_blocks_per_seq), PAD_BLOCK, dtype=np.int32)
        self._held: list[list[int]] = [[] for _ in range(max_batch)]   # row b's table as last written

    def stage(self, token_ids: list[int], positions: list[int], tables: Sequence[list[int]],
              bucket: int) -> PaddedDecode:
        """The padded step of rows (token_ids[b], positions[b], tables[b]) in a bucket of `bucket` rows."""
        n = len(tables)
        max_batch, max_blocks = self.tables.shape
        if not 0 < n <= bucket <= max_batch:
            raise ValueError(f"{n} rows do not fit a bucket of {bucket} (at most {max_batch} rows)")
        bs, arr, held = self.block_size, self.tables, self._held
        rows: Iterable[int] = ()
        if tables != held[:n]:   # else steady decoding: no table changed since last step
            # The rows that changed, found by C-level compares (sequences that started decoding in different
            # steps grow their tables in different steps: a few rows of the batch, not all, at a time).
            rows = compress(range(n), map(operator.ne, tables, held))
        for b in rows:
            t, h = tables[b], held[b]
            k, old = len(t), len(h)
            if k > max_blocks:
                raise ValueError(f"row {b}: {k} blocks exceed the {max_blocks} columns")
            if k == old + 1 and t[:old] == h:   # the table grew by a block: one element to write
                arr[b, old] = t[old]
                h.append(t[old])
                continue
            arr[b, :k] = t
            if old > k:
                arr[b, k:old] = PAD_BLOCK
            held[b] = list(t)
        for b in range(n, bucket):   # padding rows: clear what an earlier step's real row left there
            if held[b]:
                arr[b, : len(held[b])] = PAD_BLOCK
                held[b] = []
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        pos_real = np.array(positions, dtype=np.int64)
        block = pos_real // bs
        past = block >= lens
        if past.any():
            b = int(np.flatnonzero(past)[0])
            raise ValueError(f"row {b}: position {positions[b]} is past its {len(tables[b])} blocks")
        width = max(1, int(lens.max()))
        ids = np.full(bucket, PAD_TOKEN_ID, dtype=np.int64)
        pos = np.full(bucket, PAD_POSITION, dtype=np.int64)
        slot = np.full(bucket, PAD_SLOT, dtype=np.int64)
        lens_out = np.full(bucket, PAD_SEQ_LEN, dtype=np.int32)
        ids[:n] = token_ids
        pos[:n] = pos_real
        # Row b of `arr` holds table b now, so the slots are one gather.
        slot[:n] = arr[np.arange(n), block].astype(np.int64) * bs + pos_real % bs
        lens_out[:n] = pos_real + 1
        return PaddedDecode(n, bucket, ids, pos, slot, lens_out, arr[:bucket, :width].copy())


def decode_plan(num_seqs: int) -> np.ndarray:
    """The paged-attention program map of a decode step: program b -> (sequence b, query block 0).

    With one query token per sequence every program's work is one sequence, and which program handles
    which sequence never changes a result, so this plan is constant and can live in a static buffer."""
    plan = np.zeros(2 * num_seqs, dtype=np.int32)
    plan[0::2] = np.arange(num_seqs, dtype=np.int32)
    return plan


class StaticDecodeBuffers:
    """Device buffers a captured decode graph reads; `load` copies one padded step into them.

    input_ids, positions, slot_mapping, seq_lens and block_tables are views of one static image
    (runner/static_image.py): `load` writes a step into the host image and moves it with one host -> device
    copy, not one small copy per tensor. The device buffers therefore always equal the image; parts a step
    does not write keep what earlier steps wrote (valid ids, never read by that step: the module docstring
    says why). query_start_loc (0, 1, ..., B) and the attention plan never change and are written once here.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        b, w = max_batch, max_blocks_per_seq
        self.max_batch = max_batch
        self._image = StaticImage([("input_ids", (b,), np.int64), ("positions", (b,), np.int64),
                                   ("slot_mapping", (b,), np.int64), ("seq_lens", (b,), np.int32),
                                   ("block_tables", (b, w), np.int32)], device)
        self._host = self._image.host
        self._host["slot_mapping"][:] = PAD_SLOT
        self._host["seq_lens"][:] = PAD_SEQ_LEN
        # Zeros are valid block ids; stale columns past a row's table are never read (attention stops at
        # the row's own position), so `load` writes only the columns in use.
        self._image.upload()
        dev = self._image.device
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables = (
            dev[k] for k in names)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.plan = torch.from_numpy(decode_plan(max_batch)).to(device)

    def load(self, step: PaddedDecode) -> None:
        """Copy `step` into the first `step.bucket` rows (asynchronously, from pinned staging on CUDA)."""
        b = step.bucket
        width = step.block_tables.shape[1]
        tables = self._host["block_tables"]
        if b > self.max_batch or width > tables.shape[1]:
            raise ValueError(f"step of {b} rows x {width} blocks exceeds the buffers "
                             f"({self.max_batch} x {tables.shape[1]})")
        h = self._host
        h["input_ids"][:b] = step.input_ids
        h["positions"][:b] = step.positions
        h["slot_mapping"][:b] = step.slot_mapping
        h["seq_lens"][:b] = step.seq_lens
        tables[:b, :width] = step.block_tables
        self._image.upload()


def graph_metadata(buf: StaticDecodeBuffers, b: int, block_size: int, split_kv: bool = False
                   ) -> AttentionMetadata:
    """The metadata a decode graph of bucket `b` is captured with: views of the static buffers.

    Its host lengths are placeholders (one query token and context 1 per row): a graph replays the same
    launches whatever the rows' positions, so nothing it runs may read them beyond the token count. Ops
    whose launches depend on positions read the device tensors, or take `decode_plan` as their static
    program map (paged attention, and the MLA kernel's static decode plan, kernels/split_plan.py).
    `split_kv`: the graph serves steps with rows past paged attention's split threshold (its static split
    launches, kernels/paged_attention.py)."""
    return AttentionMetadata(
        slot_mapping=buf.slot_mapping[:b], positions=buf.positions[:b],
        query_start_loc=buf.query_start_loc[: b + 1], seq_lens=buf.seq_lens[:b],
        block_tables=buf.block_tables[:b], block_size=block_size, max_query_len=1,
        max_seq_len=buf.block_tables.shape[1] * block_size,
        query_lens_cpu=[1] * b, seq_lens_cpu=[1] * b, decode_plan=buf.plan[: 2 * b], split_kv=split_kv,
    )
