"""The combine step of split-KV attention, and the launch sequences both split kernels share.

A split kernel (kernels/mla_decode.py, kernels/paged_attention_kernel.py) computes, for each row and each of
its KV splits (kernels/split_plan.py), an fp32 online-softmax state: the unnormalised output `acc` [D], the
running max `m` (log2 units, the score scale folded in) and the running sum `l`. A row with one split
normalises and stores its own output; a row with several leaves one (acc, m, l) per split in a scratch
buffer, and `split_combine_kernel` merges them in increasing split order — the one merge order of that row,
whatever the launch, so the row's bits depend on its position only.

`SplitLauncher` holds the two launch sequences (the host plan and the static decode plan, split_plan.py);
a kernel's launcher subclasses it and supplies its split kernel's launch (`_split`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from deepinfer.kernels.pdl import pdl_options, wait_for_producers
from deepinfer.kernels.split_plan import SplitPolicy, get_host_plan, static_decode_ranges

if TYPE_CHECKING:
    from deepinfer.kernels.metadata import AttentionMetadata

# Scratch (fp32 partial outputs of multi-split rows) of one launch: the plan is cut into launches whose
# partials fit, so a long prefill never needs tokens x splits x heads x D floats at once.
SCRATCH_BUDGET_BYTES = 256 << 20


@triton.jit
def split_layout(pos, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(key tiles, tiles per split, splits) of the row at position `pos` (a scalar or one per row):
    kernels/split_plan.split_counts, the one layout every split kernel and the combine follow."""
    n_tiles = pos // BLOCK_N + 1
    per_split = tl.maximum((n_tiles + MAX_SPLITS - 1) // MAX_SPLITS, MIN_TILES)
    return n_tiles, per_split, (n_tiles + per_split - 1) // per_split


@triton.jit
def merge_state(m_run, l_run, o_run, m_s, l_s, a_s):
    """(max, sum, output) of the running merge after folding in one split's state (a_s [R, WIDTH], m_s, l_s
    [R]): the combine's step, also taken inside paged attention's prefill programs, so both must compute it
    alike. The sums are explicit FMAs: left as `x * alpha + y * beta`, the compiler may contract either
    product into an FMA, and which one it picks may differ between two kernels. alpha is 0 for the first
    split (m_run = -inf); every m_s is finite (a split holds a key its row sees)."""
    m_new = tl.maximum(m_run, m_s)
    alpha = tl.exp2(m_run - m_new)
    beta = tl.exp2(m_s - m_new)
    l_new = tl.fma(l_s, beta, l_run * alpha)
    o_new = tl.fma(a_s, beta[:, None], o_run * alpha[:, None])
    return m_new, l_new, o_new


@triton.jit(do_not_specialize=["slot_base", "num_heads"])
def split_combine_kernel(
    out_ptr, part_ptr, ml_ptr, tok_ptr, pos_ptr, soff_ptr, v_scale_ptr,
    slot_base, num_heads, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr, FIXED_SLOTS: tl.constexpr,
    V_SCALE: tl.constexpr = False, GROUP: tl.constexpr = 1, PDL: tl.constexpr = 0,
):
    """Merge the split partials of one token's heads (a block of BLOCK_H) into out [T, H, WIDTH].

    V_SCALE: the output is multiplied by the per-kv-head scale at v_scale_ptr[head // GROUP] after the
    normalisation (an e4m3 cache's value scale), as the split kernel does for its single-split rows."""
    wait_for_producers(PDL)   # kernels/pdl.py: the split kernel's partials are complete and visible
    if FIXED_SLOTS:   # the static decode plan: one program per token from slot_base / MAX_SPLITS on
        t = (slot_base // MAX_SPLITS + tl.program_id(0)).to(tl.int64)
    else:             # the host plan: the multi-split tokens listed at tok_ptr
        t = tl.load(tok_ptr + tl.program_id(0)).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    q_pos = tl.load(pos_ptr + t).to(tl.int32)
    _, _, n_splits = split_layout(q_pos, BLOCK_N, MIN_TILES, MAX_SPLITS)   # from its position only
    if FIXED_SLOTS:
        if n_splits == 1:
            return   # the split kernel stored this row's output itself; it left no partials
        base = t * MAX_SPLITS - slot_base
    else:
        base = tl.load(soff_ptr + t) - slot_base
    r = tl.arange(0, WIDTH)
    m_run = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_H], dtype=tl.float32)
    o_run = tl.zeros([BLOCK_H, WIDTH], dtype=tl.float32)
    for s in range(0, n_splits):   # increasing split order: the one merge order of this row
        part = (base + s) * num_heads + heads
        m_s = tl.load(ml_ptr + 2 * part, mask=h_ok, other=0.0)
        l_s = tl.load(ml_ptr + 2 * part + 1, mask=h_ok, other=1.0)
        a_s = tl.load(part_ptr + part[:, None] * WIDTH + r[None, :], mask=h_ok[:, None], other=0.0)
        m_run, l_run, o_run = merge_state(m_run, l_run, o_run, m_s, l_s, a_s)
    out = o_run / l_run[:, None]
    if V_SCALE:
        out = out * tl.load(v_scale_ptr + heads // GROUP, mask=h_ok, other=1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


class SplitLauncher:
    """The launch sequences of a split kernel and the combine, for one call.

    Subclasses set `q` (the [T, H, ...] query, for the device and token count), `meta`, `out` [T, H, WIDTH],
    `num_heads`, `width`, `policy`, `block_q` / `block_n` (the split kernel's query rows per plan entry and
    key tile), `head_blocks` (the split kernel's grid axis 1) and implement `_split`; `v_scale` / `group`
    when the combine multiplies by a per-kv-head value scale."""

    q: torch.Tensor
    meta: AttentionMetadata
    out: torch.Tensor
    num_heads: int
    width: int
    policy: SplitPolicy
    block_q: int
    block_n: int
    head_blocks: int
    v_scale: torch.Tensor | None = None
    group: int = 1
    combine_heads: int = 16   # BLOCK_H of the combine

    @property
    def slot_bytes(self) -> int:
        """Scratch of one (token, split): acc [H, WIDTH] + (max, sum) [H, 2], fp32."""
        return self.num_heads * (self.width + 2) * 4

    def _split(self, grid: tuple[int, int, int], part: torch.Tensor, ml: torch.Tensor, plan: torch.Tensor,
               soff: torch.Tensor, slot_base: int, fixed_slots: bool) -> None:
        raise NotImplementedError

    def _scratch(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(1, slots) * self.num_heads
        dev = self.q.device
        return (torch.empty((rows, self.width), dtype=torch.float32, device=dev),
                torch.empty((rows, 2), dtype=torch.float32, device=dev))

    def _combine(self, tokens: int, part: torch.Tensor, ml: torch.Tensor, tok: torch.Tensor,
                 soff: torch.Tensor, slot_base: int, fixed_slots: bool) -> None:
        out, policy = self.out, self.policy
        scale = self.v_scale
        split_combine_kernel[(tokens, triton.cdiv(self.num_heads, self.combine_heads))](
            out, part, ml, tok, self.meta.positions, soff, scale if scale is not None else ml,
            slot_base, self.num_heads, out.stride(0), out.stride(1),
            BLOCK_H=self.combine_heads, WIDTH=self.width, BLOCK_N=self.block_n,
            MIN_TILES=policy.min_tiles, MAX_SPLITS=policy.max_splits, FIXED_SLOTS=fixed_slots,
            V_SCALE=scale is not None, GROUP=self.group, num_warps=4, **pdl_options(self.q.device),
        )

    def host_planned(self) -> None:
        """Launch groups of the host plan: packed slots, the combine over multi-split tokens only."""
        plan = get_host_plan(self.meta, self.block_q, self.block_n, self.policy, self.slot_bytes,
                             SCRATCH_BUDGET_BYTES, self.q.device)
        part, ml = self._scratch(plan.max_group_slots)
        for g in plan.groups:
            self._split((g.entry_hi - g.entry_lo, self.head_blocks, g.max_splits), part, ml,
                        plan.plan[2 * g.entry_lo:], plan.soff, g.slot_base, False)
            if g.tok_hi > g.tok_lo:
                self._combine(g.tok_hi - g.tok_lo, part, ml, plan.split_tokens[g.tok_lo:], plan.soff,
                              g.slot_base, False)

    def static_decode(self, decode_plan: torch.Tensor) -> None:
        """Launches that depend on the number of tokens and the policy only (a CUDA graph's decode step):
        entry t = (sequence t, query block 0) holds token t; grid (tokens, head blocks, max_splits); token
        t's split s at slot t * max_splits + s; the combine over every token, skipping single-split rows."""
        num_tokens = self.q.shape[0]
        if decode_plan.dtype != torch.int32 or tuple(decode_plan.shape) != (2 * num_tokens,):
            raise ValueError(f"meta.decode_plan: expected int32 [{2 * num_tokens}] (one entry per token), "
                             f"got {decode_plan.dtype} {tuple(decode_plan.shape)}")
        if self.meta.num_seqs != num_tokens:
            raise ValueError(f"meta.decode_plan: {self.meta.num_seqs} sequences for {num_tokens} tokens")
        max_splits = self.policy.max_splits
        ranges = static_decode_ranges(num_tokens, max_splits, self.slot_bytes, SCRATCH_BUDGET_BYTES)
        multi = max_splits > 1   # with one split at most, no row leaves partials: no scratch, no combine
        part, ml = self._scratch((ranges[0][1] - ranges[0][0]) * max_splits if multi else 0)
        unused = self.meta.positions   # the fixed-slot kernels read no slot / token table
        for lo, hi in ranges:
            self._split((hi - lo, self.head_blocks, max_splits), part, ml, decode_plan[2 * lo:], unused,
                        lo * max_splits, True)
            if multi:
                self._combine(hi - lo, part, ml, unused, unused, lo * max_splits, True)
