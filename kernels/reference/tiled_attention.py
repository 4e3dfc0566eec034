"""Batch-invariant paged causal attention on CPU through fixed-shape batched GEMMs (the CPU fast path).

A token's bits are *defined* by canonical calls that see nothing but that token (`_canonical`: its G
query rows of one kv head atop a zero block of `_rows(1, G)` rows, fresh contiguous operands, torch.mm):
scores against each KEY_BLOCK of keys aligned to absolute position 0; the exact max over its keys; exp on
one fixed code path (pointwise.fixed_path); then per KV_CHUNK of keys p [G, 16] @ v [16, D]; chunk
results and the sums of p are added in the fixed halving tree of attention.py (trailing zero chunks add
exact zeros).

Running those calls one by one would cost a Python call per (token, head, block). Instead tokens are packed
into tiles of `qt` query tokens of one sequence (qt*G rows), and all tiles go through torch.bmm calls of
exactly UNITS[qt] matrices of one fixed shape. A GEMM's summation order depends on shapes, strides and the
code path, never on the values; so a probe on seeded random operands checks, once per (qt, G, D, thread
count), that every row of every matrix of such a call equals its canonical call. Only then is that tiling
used: where a probe fails (another BLAS, another CPU) this path declines and the caller runs
chunked_paged_attention everywhere, the same choice for every call, so a token never gets bits from two
definitions. Rows past a tile's last token, keys past a token's position and zero-padded matrices cannot
change a real row: each output element reads only its own row and column, and the value-independence above.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.metadata import KV_CHUNK, AttentionMetadata
from deepinfer.kernels.reference.attention import _halving_sum
from deepinfer.kernels.reference.pointwise import fixed_path

KEY_BLOCK = 64                      # keys per score matrix (a multiple of KV_CHUNK)
PREFILL_TILE = 32                   # query tokens per tile of a sequence with several new tokens
UNITS = {1: (32, 64), PREFILL_TILE: (16, 64)}   # matrices per bmm call: (scores, p.v), by tile size
# Bounds the float32 temporaries of one piece (p.v products: tiles x Hkv x rows x span x D/16).
_PIECE_ELEMENTS = 1 << 22
_MAX_WASTE = 2.0

_probe_ok: dict[tuple, bool] = {}


def _rows(qt: int, group: int) -> int:
    """Rows of a tile's matrices: its qt*G query rows, at least the canonical call's rows.

    BLAS kernels for tiny M (MKL: M <= 3) sum in another order than those for larger M, so the canonical
    call puts a token's G rows at the top of a zero block of a multiple of 4 (>= 4) rows.
    """
    return max(qt * group, -(-group // 4) * 4)


def _canonical(rows_g: torch.Tensor, other: torch.Tensor, group: int) -> torch.Tensor:
    """The call that defines a token's bits: its G rows atop a zero block, times `other` (fresh copies)."""
    blk = rows_g.new_zeros((_rows(1, group), rows_g.shape[1]))
    blk[:group] = rows_g
    return torch.mm(blk, other.clone())[:group]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _fixed_bmm(a: torch.Tensor, b: torch.Tensor, units: int) -> torch.Tensor:
    """bmm over a [U, M, K] and b [U, K, N] (U a multiple of `units`) as calls of exactly `units` matrices."""
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    for i in range(0, a.shape[0], units):
        torch.bmm(a[i:i + units], b[i:i + units], out=out[i:i + units])
    return out


def _padded_halving_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """attention._halving_sum of x zero-padded along `dim` to a power of two, without the padding copy.

    The first level adds the upper part onto the lower where it exists and keeps the lower entry where
    the padding is zero: x + 0.0 == x except that -0.0 becomes +0.0, and callers normalise zero signs.
    """
    n = x.shape[dim]
    wide = 1 << (n - 1).bit_length()
    if wide != n:
        half = wide // 2
        low = x.narrow(dim, 0, half).clone()
        low.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
        x = low
    return _halving_sum(x, dim)


def _probe(qt: int, group: int, head_dim: int) -> bool:
    """Whether qt-token tiles in UNITS[qt]-matrix bmm calls give every row its canonical bits (cached)."""
    key = (qt, group, head_dim, torch.get_num_threads())
    ok = _probe_ok.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(qt * 1000 + group * 10 + head_dim)
        rows = _rows(qt, group)
        us, up = UNITS[qt]
        q = torch.randn(2 * us, rows, head_dim, generator=gen)
        k = torch.randn(2 * us, KEY_BLOCK, head_dim, generator=gen)
        p = torch.rand(2 * up, rows, KV_CHUNK, generator=gen)
        v = torch.randn(2 * up, KV_CHUNK, head_dim, generator=gen)
        s = _fixed_bmm(q, k.transpose(1, 2), us)
        o = _fixed_bmm(p, v, up)
        ok = True
        for u in range(2 * us):
            ok = ok and all(_bits_equal(s[u, r:r + group], _canonical(q[u, r:r + group], k[u].t(), group))
                            for r in range(0, qt * group, group))
        for u in range(2 * up):
            ok = ok and all(_bits_equal(o[u, r:r + group], _canonical(p[u, r:r + group], v[u], group))
                            for r in range(0, qt * group, group))
        _probe_ok[key] = ok
    return ok


def tile_sizes(group: int, head_dim: int) -> tuple[int, int] | None:
    """(tile size for one-token sequences, for longer runs), or None where no tiling passes its probe."""
    one, wide = _probe(1, group, head_dim), _probe(PREFILL_TILE, group, head_dim)
    if one and wide:
        return 1, PREFILL_TILE
    if one or wide:
        qt = 1 if one else PREFILL_TILE
        return qt, qt
    return None


def _plan(meta: AttentionMetadata, positions: list[int], sizes: tuple[int, int]):
    """Tiles (first token, tokens, sequence, top position) grouped by tile size."""
    groups: dict[int, list[tuple[int, int, int, int]]] = {}
    start = 0
    for b, n in enumerate(meta.query_lens_cpu):
        qt = sizes[0] if n == 1 else sizes[1]
        for a in range(start, start + n, qt):
            e = min(a + qt, start + n)
            groups.setdefault(qt, []).append((a, e - a, b, max(positions[a:e])))
        start += n
    return groups


def _pieces(tiles: list[tuple[int, int, int, int]], budget: int) -> list[tuple[int, int, int]]:
    """Ranges of tiles [a, b) and the key blocks they read: closed before the budget (tiles x span) or
    before the slots read exceed _MAX_WASTE times those the tiles need."""
    out: list[tuple[int, int, int]] = []
    a, top, need = 0, -1, 0
    for t, tile in enumerate(tiles):
        blocks_t = tile[3] // KEY_BLOCK + 1
        new_top = max(top, tile[3])
        used = (t + 1 - a) * (new_top // KEY_BLOCK + 1)
        if t > a and (used * KEY_BLOCK > budget or used > _MAX_WASTE * (need + blocks_t)):
            out.append((a, t, top // KEY_BLOCK + 1))
            a, new_top, need = t, tile[3], 0
        top, need = new_top, need + blocks_t
    if tiles:
        out.append((a, len(tiles), top // KEY_BLOCK + 1))
    return out


def tiled_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Batch-invariant causal attention (module docstring), or None where the probes reject the tiling."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if block_size % KV_CHUNK:
        raise ValueError(f"block_size={block_size} must be a multiple of KV_CHUNK={KV_CHUNK}")
    sizes = tile_sizes(group, head_dim)
    if sizes is None:
        return None
    out = q.new_empty((num_tokens, num_q_heads, head_dim))
    if num_tokens == 0:
        return out
    positions = meta.positions.tolist()
    pos = meta.positions.to(torch.int64)
    qf = q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    qf = torch.cat([qf, qf.new_zeros((1, num_kv_heads, group, head_dim))])   # row num_tokens: padding
    pos = torch.cat([pos, pos.new_zeros(1)])                                  # padding rows see key 0
    ctx = meta.seq_lens.to(torch.int64)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    tables = meta.block_tables.to(torch.int64)
    for qt, tiles in _plan(meta, positions, sizes).items():
        budget = max(KEY_BLOCK, _PIECE_ELEMENTS // (qt * num_q_heads * head_dim // KV_CHUNK))
        for a, b, blocks in _pieces(tiles, budget):
            part = tiles[a:b]
            idx = torch.tensor([[t0 + i if i < n else num_tokens for i in range(qt)] for t0, n, _, _ in part],
                               dtype=torch.int64, device=q.device)                # [n_t, qt]
            seq = torch.tensor([s for _, _, s, _ in part], dtype=torch.int64, device=q.device)
            res = _attend_tiles(qf, pos, idx, tables[seq], ctx[seq], k_flat, v_flat,
                                block_size, blocks, scale, (k_scale, v_scale), UNITS[qt])
            real = idx.view(-1) < num_tokens
            out.index_copy_(0, idx.view(-1)[real], res.reshape(-1, num_q_heads, head_dim)[real].to(q.dtype))
    return out


def _gather(flat: torch.Tensor, rows: torch.Tensor, total: int, scale: torch.Tensor | None,
            num_kv_heads: int, span: int) -> torch.Tensor:
    """float32 [total, D]: flat's `rows` (then zero rows), times the per-kv-head FP8 scale if given."""
    head_dim = flat.shape[-1]
    out = torch.empty((total, head_dim), dtype=torch.float32, device=flat.device)
    n = rows.shape[0]
    out[n:].zero_()
    src = flat.reshape(-1, head_dim)
    if src.dtype == torch.float32:
        torch.index_select(src, 0, rows, out=out[:n])
    else:
        out[:n].copy_(src.index_select(0, rows))
    if scale is not None:  # FP8 cache: back to real values, per kv head
        out[:n].view(-1, num_kv_heads, span, head_dim).mul_(scale.to(torch.float32).view(1, -1, 1, 1))
    return out


def _attend_tiles(qf: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor, tables: torch.Tensor,
                  ctx: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, block_size: int,
                  blocks: int, scale: float, scales: tuple, units: tuple[int, int]) -> torch.Tensor:
    """Attention for n_t tiles (token indices idx [n_t, qt]) whose keys lie in the first `blocks` blocks."""
    n_t, qt = idx.shape
    _, num_kv_heads, group, head_dim = qf.shape
    rows, span, chunks = _rows(qt, group), blocks * KEY_BLOCK, blocks * KEY_BLOCK // KV_CHUNK
    dev = qf.device
    key_pos = torch.arange(span, dtype=torch.int64, device=dev)
    width = -(-span // block_size)
    if tables.shape[1] < width:  # key blocks past the table: padding (block 0), masked below
        tables = torch.cat([tables, tables.new_zeros((n_t, width - tables.shape[1]))], dim=1)
    slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size      # [n_t, span]
    # Slots past the sequence's context may hold anything (even NaN): read key 0's slot there instead
    # (masked below). Keys inside the context but past a row's own position are real values under
    # p == 0, adding exact (signed) zeros.
    slots = torch.where(key_pos[None, :] < ctx[:, None], slots, slots[:, :1])
    # Rows of the flat [slots * Hkv, D] caches, gathered straight into the [tile, head, key] order of
    # the bmm operands.
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=dev)
    rows_kv = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)        # [n_t*Hkv*span]
    us, up = units
    n_s = n_t * num_kv_heads * blocks
    n_p = n_t * num_kv_heads * chunks
    kb = _gather(k_flat, rows_kv, -(-n_s // us) * us * KEY_BLOCK, scales[0], num_kv_heads, span)
    vu = _gather(v_flat, rows_kv, -(-n_p // up) * up * KV_CHUNK, scales[1], num_kv_heads, span)
    kb, vu = kb.view(-1, KEY_BLOCK, head_dim), vu.view(-1, KV_CHUNK, head_dim)
    # Padding matrices and rows are never read back (rows are independent); zeroed so that no stale
    # denormal or NaN slows the BLAS down.
    a = qf.new_empty((kb.shape[0], rows, head_dim))
    a[n_s:].zero_()
    a[:, qt * group:].zero_()
    a[:n_s].view(n_t, num_kv_heads, blocks, rows, head_dim)[:, :, :, :qt * group].unflatten(
        3, (qt, group)).copy_(qf[idx].permute(0, 2, 1, 3, 4)[:, :, None])
    s = _fixed_bmm(a, kb.transpose(1, 2), us)[:n_s].view(n_t, num_kv_heads, blocks, rows, KEY_BLOCK)
    s.mul_(scale)
    row_pos = pos[idx].repeat_interleave(group, dim=1)
    if rows > qt * group:  # zero rows under the canonical block: position 0, discarded
        row_pos = torch.cat([row_pos, row_pos.new_zeros((n_t, rows - qt * group))], dim=1)
    masked = key_pos.view(1, 1, blocks, 1, KEY_BLOCK) > row_pos.view(n_t, 1, 1, rows, 1)
    s.masked_fill_(masked, float("-inf"))
    m = s.amax(dim=(2, 4), keepdim=True)                                              # exact; key 0 is real
    p = fixed_path(torch.exp, s.sub_(m)).view(n_t, num_kv_heads, blocks, rows, -1, KV_CHUNK)
    p_c = _halving_sum(p, 5).permute(0, 1, 3, 2, 4).reshape(n_t, num_kv_heads, rows, chunks)
    pu = qf.new_empty((vu.shape[0], rows, KV_CHUNK))
    pu[n_p:].zero_()
    pu[:n_p].view(n_t, num_kv_heads, blocks, KEY_BLOCK // KV_CHUNK, rows, KV_CHUNK).copy_(
        p.permute(0, 1, 2, 4, 3, 5))
    pv_c = _fixed_bmm(pu, vu, up)[:n_p].view(n_t, num_kv_heads, chunks, rows, head_dim)
    denom = _padded_halving_sum(p_c, 3)                                               # [n_t, Hkv, rows]
    # + 0.0: one sign for a zero sum, whatever zeros (signed, from other rows' keys) went into it.
    acc = _padded_halving_sum(pv_c, 2) + 0.0                                          # [n_t, Hkv, rows, D]
    o = (acc / denom.unsqueeze(-1))[:, :, :qt * group].reshape(n_t, num_kv_heads, qt, group, head_dim)
    return o.permute(0, 2, 1, 3, 4)                                                   # [n_t, qt, Hkv, G, D]
