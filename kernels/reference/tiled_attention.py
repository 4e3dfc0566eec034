"""Batch-invariant paged causal attention on CPU through fixed-shape batched GEMMs (the CPU fast path).

A token at position p has its own key span: the first b = p // KEY_BLOCK + 1 blocks of KEY_BLOCK keys
(absolute positions [0, b * KEY_BLOCK)), whatever else shares the batch. Its bits are *defined* by
canonical calls that see nothing but that token (`_canonical_mm`: fresh contiguous operands, torch.mm),
per kv head: scores = its G query rows atop a zero block of `_rows(1, G)` rows times its span's keys
([rows, D] @ [D, span]); keys past p set to -inf; the exact max over the row; exp on one fixed code path
(pointwise.fixed_path); the sum of p over the span in the fixed halving tree of attention.py (computed
elementwise); p [rows, span] @ v [span, D] for the weighted values (keys past p add exact zeros); the
quotient. The reductions over keys happen inside those canonical GEMMs, so a decode step costs one score
and one p.v matrix per (sequence, kv head), not one per 16-key chunk.

Running the canonical calls one by one would cost a Python call per (token, head). Instead tokens are
packed into tiles of `qt` query tokens of one sequence (qt*G rows) cut at absolute positions that are
multiples of PREFILL_TILE (a divisor of KEY_BLOCK), so every token of a tile has the same span; tiles of
one span go through torch.bmm calls of exactly UNITS[qt] matrices of one fixed shape. A GEMM's summation
order depends on shapes, strides and the code path, never on the values; so a probe on seeded random
operands checks, once per (qt, span, G, D, thread count), that every row of every matrix of such a call
equals its canonical call. One-token tiles (decode) of a step share one call group over the widest span
among them: the keys past a token's own span are masked (p == 0), and a probe per (own span, call span)
checks that the wider calls still give the canonical bits; tokens where it fails run over their own span.
Where a probe fails (another BLAS, another CPU), those tokens take the next tiling down (PREFILL_TILE ->
one-token tiles -> canonical torch.mm calls one by one): slower, the same bits. What depends only on the
step's metadata (the tiling, gather indices, masks) is an AttentionPlan, built once per step. Rows past
a tile's last token, keys past a token's position and zero-padded matrices cannot change a real row:
each output element reads only its own row and column, and the value-independence above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.attention import _halving_sum
from deepinfer.kernels.reference.pointwise import PIECE, VEC_TILE, fixed_path

KEY_BLOCK = 64                      # a token's span is a whole number of these blocks
PREFILL_TILE = 32                   # query tokens per tile of a run of several new tokens (divides KEY_BLOCK)
UNITS = {1: 16, PREFILL_TILE: 8}    # matrices per bmm call, by tile size
# Bounds the float32 temporaries of one call group (matrices x rows x span).
_PIECE_ELEMENTS = 1 << 22

_probe_ok: dict[tuple, bool] = {}


def _rows(qt: int, group: int) -> int:
    """Rows of a tile's matrices: its qt*G query rows, at least the canonical call's rows.

    BLAS kernels for tiny M (MKL: M <= 3) sum in another order than those for larger M, so the canonical
    call puts a token's G rows at the top of a zero block of a multiple of 4 (>= 4) rows.
    """
    return max(qt * group, -(-group // 4) * 4)


def _canonical_mm(rows_g: torch.Tensor, other: torch.Tensor, group: int) -> torch.Tensor:
    """The call that defines a token's bits: its G rows atop a zero block, times `other` (fresh copies,
    strides kept: the transposed keys of the score call stay transposed)."""
    blk = rows_g.new_zeros((_rows(1, group), rows_g.shape[1]))
    blk[:group] = rows_g
    return torch.mm(blk, other.clone())[:group]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _fixed_bmm(a: torch.Tensor, b: torch.Tensor, units: int | None, group: int) -> torch.Tensor:
    """a [U, M, K] @ b [U, K, N] as bmm calls of exactly `units` matrices (U a multiple of it), or, with
    units None (no bmm tiling passed its probe), as the canonical mm of each token's rows one by one."""
    if units is None:  # M == _rows(1, group) here: one token per matrix, its G rows on top
        out = a.new_zeros((a.shape[0], a.shape[1], b.shape[2]))
        for u in range(a.shape[0]):
            out[u, :group] = _canonical_mm(a[u, :group], b[u], group)
        return out
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    for i in range(0, a.shape[0], units):
        torch.bmm(a[i:i + units], b[i:i + units], out=out[i:i + units])
    return out


def _probe(qt: int, blocks: int, group: int, head_dim: int, call_blocks: int | None = None) -> bool:
    """Whether qt-token tiles of tokens whose span is `blocks` key blocks, run in UNITS[qt]-matrix bmm calls
    over `call_blocks` >= blocks key blocks (the keys past the span under p == 0), give every row its
    canonical bits (cached per thread count)."""
    call_blocks = call_blocks or blocks
    key = (qt, blocks, group, head_dim, torch.get_num_threads(), call_blocks)
    ok = _probe_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(qt * 1000 + blocks * 100 + call_blocks * 7 + group * 10
                                            + head_dim)
        rows, units = _rows(qt, group), UNITS[qt]
        span, wide = blocks * KEY_BLOCK, call_blocks * KEY_BLOCK
        q = torch.randn(2 * units, rows, head_dim, generator=gen)
        k = torch.randn(2 * units, wide, head_dim, generator=gen)
        p = torch.rand(2 * units, rows, wide, generator=gen)
        p[:, :, span:] = 0.0
        v = torch.randn(2 * units, wide, head_dim, generator=gen)
        s = _fixed_bmm(q, k.transpose(1, 2), units, group)[:, :, :span]
        o = _fixed_bmm(p, v, units, group)
        ok = True
        for u in range(2 * units):
            for r in range(0, qt * group, group):
                g = slice(r, r + group)
                ok = (ok and _bits_equal(s[u, g], _canonical_mm(q[u, g], k[u, :span].t(), group))
                      and _bits_equal(o[u, g], _canonical_mm(p[u, g, :span], v[u, :span], group)))
        _probe_ok[key] = ok
    return ok


def tile_sizes(group: int, head_dim: int, blocks: int = 1) -> tuple[int | None, int | None]:
    """(bmm units of one-token tiles, tile size of longer runs) for tokens whose span is `blocks` key
    blocks: None units = canonical mm one by one; runs take PREFILL_TILE tiles only where they pass."""
    one = _probe(1, blocks, group, head_dim)
    wide = _probe(PREFILL_TILE, blocks, group, head_dim)
    return (UNITS[1] if one else None), (PREFILL_TILE if wide else 1)


Group = tuple[int, int, "int | None"]   # (tile size, key blocks of the calls, bmm units)


def _plan(meta: AttentionMetadata, positions: list[int], group: int,
          head_dim: int) -> dict[Group, list[tuple[int, int, int]]]:
    """Tiles (first token, tokens, sequence) grouped by the calls that run them.

    Runs of several tokens: PREFILL_TILE tiles cut at multiples of PREFILL_TILE, one group per span.
    One-token tiles (decode steps): all in one group over the widest span among them, for every token
    whose probe says its span's bits survive the wider calls; the others in calls of their own span.
    """
    groups: dict[Group, list[tuple[int, int, int]]] = {}
    singles: list[tuple[int, int]] = []
    start = 0
    for s, n in enumerate(meta.query_lens_cpu):
        a = start
        while a < start + n:
            p = positions[a]
            blocks = p // KEY_BLOCK + 1
            e = min(start + n, a + PREFILL_TILE - p % PREFILL_TILE)   # cut at multiples of PREFILL_TILE
            if e - a > 1 and tile_sizes(group, head_dim, blocks)[1] == PREFILL_TILE:
                groups.setdefault((PREFILL_TILE, blocks, UNITS[PREFILL_TILE]), []).append((a, e - a, s))
            else:
                singles.extend((t, s) for t in range(a, e))
            a = e
        start += n
    if singles:
        widest = max(positions[t] for t, _ in singles) // KEY_BLOCK + 1
        for t, s in singles:
            blocks = positions[t] // KEY_BLOCK + 1
            if _probe(1, blocks, group, head_dim, widest):
                key = (1, widest, UNITS[1])
            else:
                key = (1, blocks, tile_sizes(group, head_dim, blocks)[0])
            groups.setdefault(key, []).append((t, 1, s))
    return groups


@dataclass(frozen=True)
class _Calls:
    """One group of tiles and the index tensors its calls need (the same for every layer of a step)."""

    qt: int
    span: int
    units: int | None
    total: int                    # matrices, padded to a multiple of units
    idx: torch.Tensor             # int64 [n_t * qt]: token of each tile row (num_tokens = padding)
    dest: torch.Tensor            # int64 [real rows]: where the real rows of the result go
    real: torch.Tensor            # bool [n_t * qt]
    rows_kv: torch.Tensor         # int64 [n_t * Hkv * span]: rows of the flat [slots * Hkv, D] caches
    masked: torch.Tensor          # bool [n_t, 1, rows, span]: keys past each row's position
    in_order: bool                # idx is exactly 0..num_tokens-1: the result is the whole output


@dataclass(frozen=True)
class AttentionPlan:
    """What tiled_paged_attention derives from a step's metadata alone: build it once per step
    (`plan_attention`) and pass it to every layer's call."""

    key: tuple                    # shapes and thread count the plan was built for
    inputs: tuple                 # copies of the metadata it was built from (see `fits`)
    calls: tuple[_Calls, ...]

    def fits(self, meta: AttentionMetadata, key: tuple) -> bool:
        """Whether this plan was built from metadata with these values (compared by value, so a reused
        metadata object updated in place never gets a stale plan) and these shapes."""
        return key == self.key and inputs_match(self.inputs, meta)


def metadata_inputs(meta: AttentionMetadata) -> tuple:
    """Copies of what a step plan (this module's and sdpa_attention's) is built from, for `inputs_match`."""
    return (meta.positions.clone(), meta.seq_lens.clone(), meta.block_tables.clone(),
            list(meta.query_lens_cpu))


def inputs_match(inputs: tuple, meta: AttentionMetadata) -> bool:
    """Whether `meta` holds the values (and shapes) `metadata_inputs` copied."""
    pos, seq_lens, tables, qlens = inputs
    return (meta.query_lens_cpu == qlens and _same(meta.positions, pos) and _same(meta.seq_lens, seq_lens)
            and _same(meta.block_tables, tables))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def plan_key(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> tuple:
    """What a plan depends on besides the metadata: head shapes, block size, thread count (probes)."""
    return (num_q_heads, num_kv_heads, head_dim, block_size, torch.get_num_threads())


def step_tensors(meta: AttentionMetadata) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a plan reads of a step's metadata: positions as a list; positions (int64) with a trailing 0,
    the position of the zero row that pads tiles; context lengths and block tables as int64."""
    pos = torch.cat([meta.positions.to(torch.int64), meta.positions.new_zeros(1, dtype=torch.int64)])
    return meta.positions.tolist(), pos, meta.seq_lens.to(torch.int64), meta.block_tables.to(torch.int64)


def entry_slots(entries: list[tuple[int, int, int]], qt: int, num_tokens: int, tables: torch.Tensor,
                ctx: torch.Tensor, key_pos: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For tiles of `qt` query tokens, one per entry (first token, real tokens, sequence): the token of
    every tile row, [len(entries) * qt] (num_tokens, the zero row, past an entry's real tokens), and the
    cache slot of every key position `key_pos` of the entry's span, [len(entries), span]. Key blocks past
    a sequence's table read block 0, and slots past its context (which may hold anything, even NaN) read
    key 0's slot: the caller masks both."""
    device = key_pos.device
    idx = torch.tensor([t0 + i if i < count else num_tokens for t0, count, _ in entries for i in range(qt)],
                       dtype=torch.int64, device=device)
    seq = torch.tensor([s for _, _, s in entries], dtype=torch.int64, device=device)
    tab, c = tables[seq], ctx[seq]
    width = -(-key_pos.shape[0] // block_size)
    if tab.shape[1] < width:
        tab = torch.cat([tab, tab.new_zeros((len(entries), width - tab.shape[1]))], dim=1)
    slots = tab[:, key_pos // block_size] * block_size + key_pos % block_size
    return idx, torch.where(key_pos[None, :] < c[:, None], slots, slots[:, :1])


def plan_attention(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, device: torch.device) -> AttentionPlan:
    """The call groups of one step (see _plan) with their index tensors."""
    group = num_q_heads // num_kv_heads
    num_tokens = meta.num_tokens
    key = plan_key(num_q_heads, num_kv_heads, head_dim, block_size)
    inputs = metadata_inputs(meta)
    if num_tokens == 0:
        return AttentionPlan(key, inputs, ())
    positions, pos, ctx, tables = step_tensors(meta)
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=device)
    calls = []
    for (qt, blocks, units), tiles in _plan(meta, positions, group, head_dim).items():
        rows, span = _rows(qt, group), blocks * KEY_BLOCK
        key_pos = torch.arange(span, dtype=torch.int64, device=device)
        step = max(1, _PIECE_ELEMENTS // (num_kv_heads * rows * span))
        for a in range(0, len(tiles), step):
            part = tiles[a:a + step]
            n_t = len(part)
            # Slots past the context read key 0's (masked below). Keys inside the context but past a
            # row's own position are real values under p == 0, adding exact (signed) zeros.
            idx, slots = entry_slots(part, qt, num_tokens, tables, ctx, key_pos, block_size)  # [n_t, span]
            rows_kv = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)
            row_pos = pos[idx].view(n_t, qt).repeat_interleave(group, dim=1)
            if rows > qt * group:  # zero rows under the canonical block: position 0, discarded
                row_pos = torch.cat([row_pos, row_pos.new_zeros((n_t, rows - qt * group))], dim=1)
            masked = key_pos.view(1, 1, 1, span) > row_pos.view(n_t, 1, rows, 1)
            n_m = n_t * num_kv_heads
            total = n_m if units is None else -(-n_m // units) * units
            real = idx < num_tokens
            everything = torch.arange(num_tokens, device=device)
            in_order = idx.shape[0] == num_tokens and torch.equal(idx, everything)
            calls.append(_Calls(qt, span, units, total, idx, idx[real], real, rows_kv, masked, in_order))
    return AttentionPlan(key, inputs, tuple(calls))


def tiled_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          plan: AttentionPlan | None = None) -> torch.Tensor:
    """Batch-invariant causal attention (module docstring); FP8 caches take per-kv-head scales [Hkv].

    `plan`: plan_attention(meta, ...) for this call's shapes, reused across the layers of a step.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if plan is None:
        plan = plan_attention(meta, num_q_heads, num_kv_heads, head_dim, block_size, q.device)
    out = q.new_empty((num_tokens, num_q_heads, head_dim))
    if num_tokens == 0:
        return out
    qf = q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    padded = None   # qf and a zero row (index num_tokens: padding rows of tiles), built if a tile needs it
    for c in plan.calls:
        if c.in_order:   # the tiles hold exactly tokens 0..num_tokens-1: no index pass in or out
            res = _attend_tiles(qf, c, k_cache, v_cache, scale, (k_scale, v_scale))
            out.view(res.shape).copy_(res)
            continue
        if padded is None:
            padded = torch.cat([qf, qf.new_zeros((1, num_kv_heads, group, head_dim))])
        res = _attend_tiles(padded, c, k_cache, v_cache, scale, (k_scale, v_scale))
        res = res.reshape(-1, num_q_heads, head_dim)
        out.index_copy_(0, c.dest, res[c.real].to(q.dtype))
    return out


def _gather(cache: torch.Tensor, rows: torch.Tensor, total: int, scale: torch.Tensor | None,
            span: int) -> torch.Tensor:
    """float32 [total, D]: the flat [slots * Hkv, D] cache's `rows` (then zero rows), times the per-kv-head
    FP8 scale if given."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    out = torch.empty((total, head_dim), dtype=torch.float32, device=cache.device)
    n = rows.shape[0]
    out[n:].zero_()
    src = cache.view(-1, head_dim)
    if src.dtype == torch.float32:
        torch.index_select(src, 0, rows, out=out[:n])
    else:
        out[:n].copy_(src.index_select(0, rows))
    if scale is not None:  # FP8 cache: back to real values, per kv head
        out[:n].view(-1, num_kv_heads, span, head_dim).mul_(scale.to(torch.float32).view(1, -1, 1, 1))
    return out


def _attend_tiles(qf: torch.Tensor, c: _Calls, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                  scales: tuple) -> torch.Tensor:
    """Attention for the tiles of one call group, over the first c.span keys: [n_t, qt, Hkv, G, D].

    qf: float32 [T (+ 1 zero row, unless c.in_order), Hkv, G, D] queries; c.idx indexes its rows."""
    _, num_kv_heads, group, head_dim = qf.shape
    qt, span, units, total = c.qt, c.span, c.units, c.total
    n_t = c.idx.shape[0] // qt
    rows = _rows(qt, group)
    n_m = n_t * num_kv_heads
    kb = _gather(k_cache, c.rows_kv, total * span, scales[0], span).view(total, span, head_dim)
    vb = _gather(v_cache, c.rows_kv, total * span, scales[1], span).view(total, span, head_dim)
    # Padding matrices and rows are never read back (rows are independent); zeroed so that no stale
    # denormal or NaN slows the BLAS down.
    a = qf.new_zeros((total, rows, head_dim))
    a[:n_m].view(n_t, num_kv_heads, rows, head_dim)[:, :, :qt * group].unflatten(2, (qt, group)).copy_(
        (qf if c.in_order else qf.index_select(0, c.idx)).view(n_t, qt, num_kv_heads, group, head_dim)
        .transpose(1, 2))
    s = _fixed_bmm(a, kb.transpose(1, 2), units, group)                               # [total, rows, span]
    s.mul_(scale)
    s[:n_m].view(n_t, num_kv_heads, rows, span).masked_fill_(c.masked, float("-inf"))
    m = s.amax(dim=2, keepdim=True)                                                   # exact; key 0 is real
    p = _exp_(s.sub_(m))                                                              # [total, rows, span]
    denom = _padded_halving_sum(p[:n_m], 2)                                           # [n_m, rows]
    # + 0.0: one sign for a zero sum, whatever zeros (signed, from keys past the row) went into it.
    acc = _fixed_bmm(p, vb, units, group)[:n_m] + 0.0                                 # [n_m, rows, D]
    o = (acc / denom.unsqueeze(-1))[:, :qt * group].reshape(n_t, num_kv_heads, qt, group, head_dim)
    return o.permute(0, 2, 1, 3, 4)                                                   # [n_t, qt, Hkv, G, D]


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of a fresh contiguous x in place, each element on the vectorised path on one thread.

    The same pieces as pointwise.fixed_path without its padded copy: x's size is a whole number of
    VEC_TILE here (rows are a multiple of 4, spans of KEY_BLOCK), so every piece is whole SIMD blocks.
    """
    flat = x.view(-1)
    if flat.numel() % VEC_TILE:
        return fixed_path(torch.exp, x)
    for i in range(0, flat.numel(), PIECE):
        piece = flat[i:i + PIECE]
        torch.exp(piece, out=piece)
    return x


def _padded_halving_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """attention._halving_sum of x zero-padded along `dim` to a power of two, without the padding copy.

    The first level adds the upper part onto the lower where it exists and keeps the lower entry where
    the padding is zero: x + 0.0 == x except that -0.0 becomes +0.0, and p >= 0 here (exp) has no -0.0.
    """
    n = x.shape[dim]
    wide = 1 << (n - 1).bit_length()
    if wide != n:
        half = wide // 2
        low = x.narrow(dim, 0, half).clone()
        low.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
        x = low
    return _halving_sum(x, dim)
