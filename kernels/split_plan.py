"""Split-KV launch plans shared by the attention kernels that split a row's keys (kernels/mla_decode.py,
kernels/paged_attention.py): which programs run, and where a row with several KV splits keeps its partial
results. Host-side only (numpy, torch): no Triton here.

A row at position p has n_tiles = p // BLOCK_N + 1 key tiles, cut into `split_counts` consecutive ranges of
max(min_tiles, ceil(n_tiles / max_splits)) tiles: a function of the row's own position and the
`SplitPolicy` only, never of the batch. A program covers one plan entry (sequence, query block), one head
block and one split index; a row with n_splits(p) > 1 leaves one (acc, max, sum) partial per split in a
scratch buffer, which the combine kernel (kernels/split_combine.py) merges in split order. Two plan forms
give the same programs per token and the same arithmetic; only the grid's extent and the partials'
addresses differ, so a token's output bits are the same under either:

- the host plan (`get_host_plan`), for any mix of prefill and decode rows: built from the step's host
  lengths; the grid's split axis is the most splits of any row of a launch group, each multi-split token's
  slots are packed one after another (`soff`), and the combine runs over the multi-split tokens only;
- the static decode plan (`static_decode_ranges`), for a decode step of single-token rows whose positions
  the host does not know (a CUDA graph replays one launch sequence for any positions): the split axis is
  `policy.max_splits` (programs past a row's own split count do nothing), token t's split s lives at slot
  t * max_splits + s, and the combine runs over every token, leaving single-split rows alone. It depends
  on the number of tokens, the policy and the slot size only.

Both cut their launches so that one launch's scratch fits `budget` bytes (at least one entry / token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer.kernels.metadata import plan_cached_on

if TYPE_CHECKING:
    from deepinfer.kernels.metadata import AttentionMetadata

_PLAN_ATTR = "_split_kv_plans"


@dataclass(frozen=True)
class SplitPolicy:
    """How a row's KV tiles are split: at most `max_splits` splits of at least `min_tiles` tiles each."""

    min_tiles: int
    max_splits: int

    def __post_init__(self) -> None:
        if self.min_tiles < 1 or self.max_splits < 1:
            raise ValueError(f"SplitPolicy({self.min_tiles}, {self.max_splits}): min_tiles and max_splits "
                             "must be >= 1")

    def split_from(self, block_n: int) -> int | None:
        """The first position whose row takes more than one split with key tiles of `block_n` (split counts
        grow with the position: `split_counts`); None when no row ever does."""
        return self.min_tiles * block_n if self.max_splits > 1 else None


# MLA's deterministic mode: rows below 16 tiles (512 positions at BLOCK_N=32) take one split; longer ones up
# to 4. (Paged attention's policies: kernels/paged_attention.py, attention_split_policy.)
DETERMINISTIC_SPLITS = SplitPolicy(min_tiles=16, max_splits=4)
NO_SPLIT = SplitPolicy(min_tiles=1 << 30, max_splits=1)


def split_counts(positions: np.ndarray, block_n: int, min_tiles: int, max_splits: int) -> np.ndarray:
    """Number of KV splits of the row at each position: the split layout depends on the position only
    (the kernels compute the same from a row's position)."""
    n_tiles = positions // block_n + 1
    per_split = np.maximum(-(-n_tiles // max_splits), min_tiles)
    return -(-n_tiles // per_split)


@dataclass
class Group:
    """One launch of the host plan."""

    entry_lo: int           # plan entries [entry_lo, entry_hi) launched together
    entry_hi: int
    max_splits: int         # most splits of any row of the group (grid axis 2)
    slot_base: int          # first scratch slot of the group (global slot numbering)
    num_slots: int
    tok_lo: int             # the group's multi-split tokens: split_tokens[tok_lo:tok_hi]
    tok_hi: int


@dataclass
class HostPlan:
    plan: torch.Tensor          # int32 [2 * entries]: (sequence, query block), in token order
    soff: torch.Tensor          # int64 [T]: first scratch slot of each multi-split token (-1 otherwise)
    split_tokens: torch.Tensor  # int32 [n]: the multi-split tokens, ascending
    groups: list[Group]
    max_group_slots: int


def build_host_plan(query_lens: list[int], seq_lens: list[int], block_q: int, block_n: int,
                    policy: SplitPolicy, slot_bytes: int, budget: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Group]]:
    """Host plan (vectorised): entries in token order, each multi-split token's scratch slots, groups."""
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    num_tokens = int(q.sum())
    starts = np.concatenate([[0], np.cumsum(q)])
    seq_of = np.repeat(np.arange(len(q)), q)
    positions = np.arange(num_tokens) - starts[seq_of] + (s - q)[seq_of]
    counts = split_counts(positions, block_n, policy.min_tiles, policy.max_splits)
    soff = np.concatenate([[0], np.cumsum(np.where(counts > 1, counts, 0))])
    blocks = -(-q // block_q)
    entry_seq = np.repeat(np.arange(len(q)), blocks)
    entry_qb = np.arange(int(blocks.sum())) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    first = starts[entry_seq] + entry_qb * block_q                     # first token of each entry
    bounds = np.append(first, num_tokens)                              # entry e: [bounds[e], bounds[e+1])
    slot_at = soff[bounds]                                             # scratch slots used before entry e
    per_launch = max(1, budget // slot_bytes)
    multi = np.nonzero(counts > 1)[0]
    groups: list[Group] = []
    lo, num_entries = 0, len(first)
    while lo < num_entries:
        # the most entries from lo whose slots fit the budget (at least one)
        hi = max(lo + 1, int(np.searchsorted(slot_at, slot_at[lo] + per_launch, side="right")) - 1)
        hi = min(hi, num_entries)
        a, b = int(bounds[lo]), int(bounds[hi])
        groups.append(Group(lo, hi, int(counts[a:b].max()), int(slot_at[lo]), int(slot_at[hi] - slot_at[lo]),
                            int(np.searchsorted(multi, a)), int(np.searchsorted(multi, b))))
        lo = hi
    plan = np.stack([entry_seq, entry_qb], axis=1).reshape(-1)
    return plan, np.where(counts > 1, soff[:-1], -1), multi, groups


def get_host_plan(meta: AttentionMetadata, block_q: int, block_n: int, policy: SplitPolicy, slot_bytes: int,
                  budget: int, device: torch.device) -> HostPlan:
    """The step's host plan, cached on `meta` while its host lengths are unchanged (one build per step)."""

    def dev(a: np.ndarray) -> torch.Tensor:
        # From pinned memory without blocking, so building a step's plan never waits for the device to
        # catch up (the overlapped loop builds it while the step before runs).
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def build(q_lens: list[int], s_lens: list[int]) -> HostPlan:
        plan, soff, multi, groups = build_host_plan(q_lens, s_lens, block_q, block_n, policy, slot_bytes,
                                                    budget)
        return HostPlan(dev(plan.astype(np.int32)), dev(soff), dev(multi.astype(np.int32)), groups,
                        max((g.num_slots for g in groups), default=0))

    key = (block_q, block_n, policy, slot_bytes, budget, str(device))
    return plan_cached_on(meta, _PLAN_ATTR, key, build)


def static_decode_ranges(num_tokens: int, max_splits: int, slot_bytes: int, budget: int
                         ) -> list[tuple[int, int]]:
    """The launches of the static decode plan: token ranges [lo, hi) in order, each needing at most
    `budget` bytes of scratch for its (hi - lo) * max_splits slots (at least one token per launch).

    Token t's split s is at scratch slot t * max_splits + s - lo * max_splits of its launch. A function of
    its arguments only, never of the rows' positions: a CUDA graph captures the same launches for any step
    of `num_tokens` decode rows."""
    if num_tokens < 0 or max_splits < 1 or slot_bytes < 1:
        raise ValueError(f"num_tokens={num_tokens}, max_splits={max_splits}, slot_bytes={slot_bytes}")
    per_launch = max(1, budget // (max_splits * slot_bytes))
    return [(lo, min(lo + per_launch, num_tokens)) for lo in range(0, num_tokens, per_launch)]
