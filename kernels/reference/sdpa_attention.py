"""Batch-invariant paged causal attention on CPU through torch's fused SDPA kernel (the CPU fast path).

A token at position p attends to its own key span: the first b = p // KEY_BLOCK + 1 blocks of KEY_BLOCK keys,
whatever else shares the batch. Its bits are *defined* by one canonical call that sees nothing but that
token (`_canonical`): torch's scaled_dot_product_attention over q [1, Hkv, R, D] (its G query rows of each kv
head atop R - G zero rows; R is G padded to a multiple of 4, or of 8 where the 4-row form fails its probe),
fresh contiguous K, V of its span (the caches' [span, Hkv, D] layout) and an additive mask row that is -inf
for the keys past p. On CPU that is one fused kernel per (kv head): q @ k^T, scale + mask,
max, exp and sum, p @ v, the quotient, with no per-step Python over those passes.

A call's rows are computed per (batch entry, head, block of query rows): each such work item runs the same
GEMMs and vector loops on its own rows and keys, whatever the other items are, except for what the kernel
chooses from the call's shapes (the query row block, the per-thread scratch layout). So a call of many
tokens of one span (decode: one token per entry; prefill: tiles of PREFILL_TILE tokens of one sequence,
their G-row groups stacked into one entry and padded to whole query blocks) gives every token its canonical
bits exactly when the kernel's code path is value-independent, which a probe on seeded random operands
checks once per (kind, rows, span, G, D, thread count), at several batch sizes (work items land on other
threads). Where a probe fails (another BLAS or CPU), those tokens take the next form down (a prefill tile
-> one-token entries -> canonical calls one by one): slower, the same bits.

Keys past a token's context read key 0's slot (masked); padding rows and entries are discarded. What
depends only on the step's metadata (groups, gather indices, masks) is an SdpaPlan, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.tiled_attention import (
    KEY_BLOCK,
    PREFILL_TILE,
    _bits_equal,
    entry_slots,
    inputs_match,
    metadata_inputs,
    plan_key,
    step_tensors,
)

# Entries per probed call (work items land on other threads as the count changes), by kind; a tile probe
# checks these of its tokens against their canonical calls (first, second, middle, last row groups).
_PROBE_BATCHES = {"one": (1, 3, 8), "tile": (1, 3)}
_TILE_PROBE_TOKENS = (0, 1, PREFILL_TILE // 2 - 1, PREFILL_TILE - 1)
_probe_ok: dict[tuple, bool] = {}


def _entry_rows(group: int, mult: int) -> int:
    """Query rows of a one-token entry: its G rows padded to a multiple of `mult` (4 or 8: BLAS kernels for
    M <= 3 sum in another order, and the kernel's per-thread scratch then stays 32- or 64-byte aligned)."""
    return -(-group // mult) * mult


def entry_form(blocks: int, group: int, head_dim: int, num_kv_heads: int) -> tuple[int, bool]:
    """(rows, batched) of the one-token entries of tokens whose span is `blocks` key blocks: the first row
    padding whose batched calls pass their probe, else multiple-of-4 rows in canonical calls one by one.
    The rows are part of the canonical call, so this depends only on the span and the machine."""
    for mult in (4, 8):
        rows = _entry_rows(group, mult)
        if _probe("one", blocks, group, head_dim, num_kv_heads, rows):
            return rows, True
    return _entry_rows(group, 4), False


def tile_rows(tokens: int, group: int) -> int:
    """Query rows of a prefill tile entry: tokens * G padded to whole query blocks of torch's CPU kernel
    (32 rows below 192, 64 below 768, else 256), so no block of a tile has a short M."""
    rows = tokens * group
    block = 32 if rows < 192 else 64 if rows < 768 else 256
    return -(-rows // block) * block


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _mask(key_pos: torch.Tensor, row_pos: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1, rows, span]: 0 where key <= the row's position, -inf past it."""
    m = torch.zeros((row_pos.shape[0], 1, row_pos.shape[1], key_pos.shape[0]))
    return m.masked_fill_(key_pos.view(1, 1, 1, -1) > row_pos.view(row_pos.shape[0], 1, -1, 1), float("-inf"))


def _heads_view(kv: torch.Tensor) -> torch.Tensor:
    """[n, span, Hkv, D] (the caches' token-major layout, as gathered) -> the [n, Hkv, span, D] view SDPA
    takes (no copy: the kernel reads any strides)."""
    return kv.permute(0, 2, 1, 3)


def _canonical(q_g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float,
               rows: int) -> torch.Tensor:
    """The call that defines a token's bits: q_g [Hkv, G, D] its query rows (atop rows - G zero rows), k, v
    [span, Hkv, D] its span's keys (fresh contiguous copies) -> [Hkv, G, D]."""
    num_kv_heads, group, head_dim = q_g.shape
    span = k.shape[0]
    a = q_g.new_zeros((1, num_kv_heads, rows, head_dim))
    a[0, :, :group] = q_g
    mask = _mask(torch.arange(span), torch.tensor([[pos]]))
    o = _sdpa(a, _heads_view(k[None].clone()), _heads_view(v[None].clone()), mask, scale)
    return o[0, :, :group] + 0.0


def _probe(kind: str, blocks: int, group: int, head_dim: int, num_kv_heads: int, canon_rows: int) -> bool:
    """Whether calls of `kind` ("one": one-token entries of canon_rows rows; "tile": PREFILL_TILE-token
    entries) over tokens whose span is `blocks` key blocks give every token the bits of its canonical call
    of canon_rows rows (cached per thread count)."""
    key = (kind, blocks, group, head_dim, num_kv_heads, canon_rows, torch.get_num_threads())
    ok = _probe_ok.get(key)
    if ok is not None:
        return ok
    span = blocks * KEY_BLOCK
    qt = 1 if kind == "one" else PREFILL_TILE
    rows = canon_rows if kind == "one" else tile_rows(qt, group)
    scale = head_dim ** -0.5
    ok = True
    for n in _PROBE_BATCHES[kind]:
        gen = torch.Generator().manual_seed(blocks * 1000 + group * 100 + head_dim + n + qt)
        q = torch.randn(n, qt, num_kv_heads, group, head_dim, generator=gen)
        k = torch.randn(n, span, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, span, num_kv_heads, head_dim, generator=gen)
        first = (span - KEY_BLOCK) if qt == 1 else span - KEY_BLOCK + PREFILL_TILE * (blocks % 2)
        pos = first + (torch.arange(n * qt).view(n, qt) % KEY_BLOCK if qt == 1 else torch.arange(qt)[None])
        pos = pos.expand(n, qt)
        a = q.new_zeros((n, num_kv_heads, rows, head_dim))
        a[:, :, :qt * group] = q.permute(0, 2, 1, 3, 4).reshape(n, num_kv_heads, qt * group, head_dim)
        row_pos = torch.zeros((n, rows), dtype=torch.int64)
        row_pos[:, :qt * group] = pos.repeat_interleave(group, dim=1)
        out = _sdpa(a, _heads_view(k), _heads_view(v), _mask(torch.arange(span), row_pos), scale) + 0.0
        got = out[:, :, :qt * group].view(n, num_kv_heads, qt, group, head_dim)
        for i in range(n):
            for t in (range(qt) if qt == 1 else _TILE_PROBE_TOKENS):
                want = _canonical(q[i, t], k[i], v[i], int(pos[i, t]), scale, canon_rows)
                ok = ok and _bits_equal(got[i, :, t], want)
            if not ok:
                break
        if not ok:
            break
    _probe_ok[key] = ok
    return ok


@dataclass(frozen=True)
class _Calls:
    """One group of entries of one kind and span, and the index tensors its calls need (every layer)."""

    qt: int                       # tokens per entry
    rows: int                     # query rows per entry
    span: int
    batched: bool                 # one call for all entries (its probe passed), else one call per entry
    idx: torch.Tensor             # int64 [n * qt]: token of each entry slot (num_tokens = padding)
    dest: torch.Tensor            # int64 [real slots]: where the real slots of the result go
    real: torch.Tensor            # bool [n * qt]
    slots: torch.Tensor           # int64 [n * span]: cache slots of each entry's keys
    mask: torch.Tensor            # float32 [n, 1, rows, span]: -inf for keys past each row's position


@dataclass(frozen=True)
class SdpaPlan:
    """What sdpa_paged_attention derives from a step's metadata alone: built once per step."""

    key: tuple
    inputs: tuple
    calls: tuple[_Calls, ...]

    def fits(self, meta: AttentionMetadata, key: tuple) -> bool:
        """Whether this plan was built from metadata with these values and these shapes (compared by value,
        so a metadata object updated in place never gets a stale plan)."""
        return key == self.key and inputs_match(self.inputs, meta)


def _groups(meta: AttentionMetadata, positions: list[int], group: int, head_dim: int,
            num_kv_heads: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """Entries (first token, tokens, sequence) by (tokens per entry, key blocks): runs of several tokens cut
    at multiples of PREFILL_TILE into tiles where their probe passes, one-token entries elsewhere."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    start = 0
    for s, n in enumerate(meta.query_lens_cpu):
        a = start
        while a < start + n:
            p = positions[a]
            blocks = p // KEY_BLOCK + 1
            e = min(start + n, a + PREFILL_TILE - p % PREFILL_TILE)
            canon = entry_form(blocks, group, head_dim, num_kv_heads)[0]
            if e - a > 1 and _probe("tile", blocks, group, head_dim, num_kv_heads, canon):
                groups.setdefault((PREFILL_TILE, blocks), []).append((a, e - a, s))
            else:
                for t in range(a, e):
                    groups.setdefault((1, blocks), []).append((t, 1, s))
            a = e
        start += n
    return groups


def plan_sdpa_attention(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int, device: torch.device) -> SdpaPlan:
    """The call groups of one step (see _groups) with their index tensors and masks."""
    group = num_q_heads // num_kv_heads
    num_tokens = meta.num_tokens
    key = plan_key(num_q_heads, num_kv_heads, head_dim, block_size)
    inputs = metadata_inputs(meta)
    if num_tokens == 0:
        return SdpaPlan(key, inputs, ())
    positions, pos, ctx, tables = step_tensors(meta)
    calls = []
    for (qt, blocks), entries in _groups(meta, positions, group, head_dim, num_kv_heads).items():
        span = blocks * KEY_BLOCK
        one_rows, one_batched = entry_form(blocks, group, head_dim, num_kv_heads)
        rows = one_rows if qt == 1 else tile_rows(qt, group)
        key_pos = torch.arange(span, dtype=torch.int64, device=device)
        n = len(entries)
        idx, slots = entry_slots(entries, qt, num_tokens, tables, ctx, key_pos, block_size)  # [n, span]
        row_pos = torch.zeros((n, rows), dtype=torch.int64, device=device)  # padding rows: position 0
        row_pos[:, :qt * group] = pos[idx].view(n, qt).repeat_interleave(group, dim=1)
        batched = one_batched if qt == 1 else True
        real = idx < num_tokens
        calls.append(_Calls(qt, rows, span, batched, idx, idx[real], real, slots.reshape(-1),
                            _mask(key_pos, row_pos)))
    return SdpaPlan(key, inputs, tuple(calls))


def sdpa_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, plan: SdpaPlan | None = None) -> torch.Tensor:
    """Batch-invariant causal attention over the paged caches (module docstring).

    `plan`: plan_sdpa_attention(meta, ...) for this call's shapes, reused across the layers of a step.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if plan is None:
        plan = plan_sdpa_attention(meta, num_q_heads, num_kv_heads, head_dim, block_size, q.device)
    out = q.new_empty((num_tokens, num_q_heads, head_dim))
    if num_tokens == 0:
        return out
    # qf and a zero row (index num_tokens: padding slots of tiles)
    qf = torch.cat([q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim),
                    q.new_zeros((1, num_kv_heads, group, head_dim), dtype=torch.float32)])
    for c in plan.calls:
        n = c.idx.shape[0] // c.qt
        kb, vb = (_heads_view(_gather(cache, c.slots).view(n, c.span, num_kv_heads, head_dim))
                  for cache in (k_cache, v_cache))
        real_rows = c.qt * group
        a = qf.new_zeros((n, num_kv_heads, c.rows, head_dim))
        a[:, :, :real_rows].view(n, num_kv_heads, c.qt, group, head_dim).copy_(
            qf.index_select(0, c.idx).view(n, c.qt, num_kv_heads, group, head_dim).transpose(1, 2))
        if c.batched:
            o = _sdpa(a, kb, vb, c.mask, scale)
        else:  # the canonical call of each token, one by one
            o = torch.cat([_sdpa(a[i:i + 1], kb[i:i + 1], vb[i:i + 1], c.mask[i:i + 1], scale)
                           for i in range(n)])
        # + 0.0: one sign for a zero, whatever signed zeros the masked keys (p == 0) added.
        o = o[:, :, :real_rows].add_(0.0)
        if c.qt == 1:  # one token per entry, every entry real
            out.view(num_tokens, num_kv_heads, group, head_dim).index_copy_(0, c.dest, o.to(q.dtype))
            continue
        res = o.reshape(n, num_kv_heads, c.qt, group, head_dim).transpose(1, 2)
        res = res.reshape(n * c.qt, num_q_heads, head_dim)
        out.index_copy_(0, c.dest, res[c.real].to(q.dtype))
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float32 [len(slots), Hkv * D]: the caches' rows of these slots (every kv head of a slot at once)."""
    src = cache.view(-1, cache.shape[2] * cache.shape[3])
    if src.dtype == torch.float32:
        return src.index_select(0, slots)
    return src.index_select(0, slots).to(torch.float32)
