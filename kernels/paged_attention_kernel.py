"""The Triton body of `paged_attention` (kernels/paged_attention.py holds the launcher, the tile configs and
the batch-invariance argument). Six constexpr knobs beyond the tile shape; the engine runs the untransposed
tile with FP16_KV, V_CVT, PREFETCH and DOT_SUM on an e4m3 cache, the others are measured alternatives.
With MAX_SPLITS > 0 it runs the split-KV layout (kernels/paged_attention.py's docstring; the untransposed
tile only) in one of three forms with the same arithmetic per row:

- ONE_TOKEN (decode steps): grid axis 2 is the split index; a row of several splits leaves its split's
  (acc, max, sum) at its scratch slot for kernels/split_combine.py, a row of one split stores its output as
  the one-program form does. Small decode batches of long rows get programs enough to fill the GPU.
- MERGE (prefill and mixed steps of the four-warp plain tiles): one program reduces all of its rows' ranges
  itself. At the last tile of a range that is not the row's last, the row's state is folded into a running
  merge with kernels/split_combine.py's `merge_state` (the combine's step, in its order) and restarts from
  the fresh state a split program starts from; after the loop the last range is folded and the merge
  normalised, exactly as the combine does. No scratch, no second launch, no partial stores.
- otherwise (prefill and mixed steps of the one- and two-warp DOT_SUM tiles, whose registers cannot hold the
  running merge's second accumulator): grid axis 2 is the split index as in decode, each row with its own
  layout; rows of several splits leave partials for the combine.

The knobs:

- SWAP: compute the transposed tile S^T = K Q^T [BLOCK_N, BLOCK_M] and O^T += V^T P^T. Keys/values then
  are the left MMA operand, which Hopper's wgmma can take from registers: a converted e4m3 tile goes
  straight from its conversion to the tensor core instead of back through shared memory, and the query rows
  are the MMA's N dimension (down to 8-16), so a decode tile is not padded to 64 rows. The softmax state
  of a query row is then a column's, reduced over axis 0.
- FP16_KV (e4m3 cache only): the products run in fp16 instead of q's bf16. e4m3 -> fp16 is one exact
  hardware conversion (every e4m3 value is an fp16 value), e4m3 -> bf16 is not. q is brought into fp16's
  range row by row: each row is multiplied by the power of two 2^(14 - E) with 2^E <= max|row| < 2^(E+1),
  so its largest element lies in [2^14, 2^15) (no overflow: fp16 max 65504), and the inverse power is
  folded into that row's score scale. Multiplying by a power of two is exact, so every element at least
  2^-31 of its row's max converts exactly (smaller ones round to fp16's subnormal grid; they move a score
  by < 2^-31 relative). The scale is a function of the row's own values only: row-local like everything
  else, so batch invariance is untouched.
- V_NAT (SWAP only): load a value tile in its memory order [keys, head_dim] and transpose it in registers
  (after the conversion) instead of loading it transposed; same values and bits, another layout path to the
  MMA (benchmarks/attn_variants.py: faster on a bf16 cache, slower on e4m3).
- V_CVT (e4m3 cache, value tiles in memory order: the untransposed tile, or V_NAT): the converted value
  tile is multiplied by an exact 1 read at run time before it becomes an MMA operand. The products then
  consume 16-bit values that already sit in registers, which Triton moves to the MMA through shared memory
  as 16-bit tiles (stores, ldmatrix.trans); without it Triton loads the operand from the e4m3 tile in
  shared memory a byte at a time (the MMA wants pairs of consecutive keys; the cache holds consecutive
  head dims). Same values, so the same bits as without it. H200, 8B heads: decode 158 -> 134 us against
  the transposed tile (benchmarks/RESULTS.md, 2026-12-02 16:58 UTC).
- PREFETCH (untransposed tile): tile j + 1's block ids are loaded while tile j runs. Left alone, Triton's
  pipeliner sees block ids -> key/value addresses -> copies as one chain inside each iteration: at 2 stages
  it keeps one shared-memory buffer per operand, issues the next copy after the products and waits for it
  at the top of the next iteration, so a program never overlaps its own loads with its arithmetic. With the
  ids a loop-carried value, 3 stages double-buffer the copies (tile j + 1 in flight during tile j). Data
  movement only: the same bits. H200, e4m3 cache: 8B decode 134 -> 121 us, 0.5B 22.4 -> 21.0 (prefill
  unchanged); a bf16 cache gains nothing (it already reads at ~4.1 TB/s) and keeps 2 stages.
- DOT_SUM (untransposed tile): a row's softmax denominator is accumulated as p @ ones, an MMA chain in the
  same order as p @ V, instead of a tl.sum whose order follows the warps' layout. A row's bits then no
  longer depend on how many warps share the tile, so decode can run one-warp programs (no barriers or
  exchanges between warps inside the loop; 8-12 programs per SM) while prefill runs wider ones. It sums the
  16-bit p that multiplies V (the denominator normalises exactly the weights the numerator used). H200,
  e4m3 cache: 8B decode 121 -> 106.5 us, 0.5B 20.7 -> 18.9 (benchmarks/RESULTS.md, 2026-12-03).
"""

from __future__ import annotations

import triton
import triton.language as tl
from deepinfer.kernels.pdl import wait_for_producers
from deepinfer.kernels.split_combine import merge_state, split_layout


@triton.jit
def _row_pow2_scale(q):
    """(q scaled row-wise into fp16 range, as fp16; the per-row power of two that undoes the scaling)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    ebits = tl.minimum(tl.maximum(ebits, 15), 254)     # 0 rows (padding) and extreme rows stay finite
    mult = ((268 - ebits) << 23).to(tl.float32, bitcast=True)     # 2^(14 - E), E = ebits - 127
    inv = ((ebits - 14) << 23).to(tl.float32, bitcast=True)       # 2^(E - 14)
    return (qf * mult[:, None]).to(tl.float16), inv


@triton.jit
def _tile_blocks(bt_row, j, last_pos, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache block of each position of key tile j (block 0 past `last_pos`: those loads are masked)."""
    kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_pos <= last_pos, other=0).to(tl.int64)


@triton.jit
def _load_tile(base, block, j, last_pos, stride_b, stride_s, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Key or value tile j [BLOCK_N, HEAD_DIM] of one kv head; positions past `last_pos` read as 0 (never
    loaded: unwritten slots may hold NaN bits)."""
    kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    return tl.load(base + block[:, None] * stride_b + (kv_pos % BLOCK_SIZE)[:, None] * stride_s + d[None, :],
                   mask=(kv_pos <= last_pos)[:, None], other=0.0)


@triton.jit
def _tile_update(q, k, v, kv_pos, q_pos, row_scale, m_i, l_i, acc, cvt_one, IEEE: tl.constexpr,
                 KV_FP8: tl.constexpr, V_CVT: tl.constexpr, DOT_SUM: tl.constexpr, lo_pos=0,
                 SPLIT: tl.constexpr = False):
    """One key tile of the untransposed online softmax: (running max, running sum, accumulator) after it.
    Under DOT_SUM the running sum is a [BLOCK_M, 16] tile whose columns all hold the row's sum. A row sees
    the keys at positions <= its q_pos; under SPLIT (a prefill split program) also >= its lo_pos, the first
    key of its split. Otherwise a row's state is fresh (max -inf) only before the first tile of a range,
    which always holds a key the row sees, so the max after a tile is finite."""
    if KV_FP8:   # exact: every e4m3 value is a bf16/fp16/fp32 value
        k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SPLIT:
        seen = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] >= lo_pos[:, None])
    else:
        seen = kv_pos[None, :] <= q_pos[:, None]
    s = tl.where(seen, s * row_scale[:, None], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # An unchanged max must rescale by exactly 1 (not by a hardware exp2 approximation of 2^0), so tiles
    # that are fully masked for a row leave its state bit-identical.
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
    if SPLIT:   # a row whose split has not started yet (max still -inf) subtracts 0: p = 0, not NaN
        p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
    else:
        p = tl.exp2(s - m_new[:, None])
    if KV_FP8:
        v = v.to(q.dtype)
        if V_CVT:
            v = v * cvt_one
    acc = acc * alpha[:, None]
    pv = p.to(v.dtype)
    if DOT_SUM:
        # The row sums as a product with ones: the tensor core sums a row in a fixed order, whatever the
        # warps' layout (a tl.sum's order follows the layout), of the same rounded p that multiplies V.
        ones = tl.full([v.shape[0], 16], 1.0, v.dtype)
        if IEEE:
            l_i = tl.dot(pv, ones, l_i * alpha[:, None], input_precision="ieee")
        else:
            l_i = tl.dot(pv, ones, l_i * alpha[:, None])
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(pv, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(pv, v, acc)
    return m_new, l_i, acc


@triton.jit
def _store_out(out_ptr, out, t, head, d, stride_ot, stride_oh, rows, v_scale_ptr, kv_head,
               KV_FP8: tl.constexpr):
    """The normalised output of `rows` (an e4m3 cache's value scale applied) in out's dtype."""
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _store_partial(part_ptr, ml_ptr, soff_ptr, t, head, d, split, slot_base, num_heads, acc, m_i, l_i, rows,
                   HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr, FIXED_SLOTS: tl.constexpr):
    """A split's state (acc, max, sum) of `rows` at their scratch slots (kernels/split_combine.py). The
    offsets stay int32 (a launch's scratch is below 2^31 floats, split_combine.SCRATCH_BUDGET_BYTES): 64-bit
    address tiles of the fp32 partial cost the epilogue its registers."""
    if FIXED_SLOTS:   # where the partial goes changes no arithmetic
        slot = t * MAX_SPLITS - slot_base + split
    else:
        slot = tl.load(soff_ptr + t, mask=rows, other=0) - slot_base + split
    part = (slot * num_heads + head).to(tl.int32)
    tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=rows[:, None])
    tl.store(ml_ptr + 2 * part, m_i, mask=rows)
    tl.store(ml_ptr + 2 * part + 1, l_i, mask=rows)


@triton.jit
def _fold_ended(ends, m_i, l_i, acc, m_run, l_run, o_run, DOT_SUM: tl.constexpr):
    """For the rows in `ends`: fold their range's state into their running merge (split_combine's step) and
    restart it from a split program's fresh state; other rows keep both exactly."""
    if DOT_SUM:
        l_row = tl.max(l_i, axis=1)    # every column holds the sum
    else:
        l_row = l_i
    m_new, l_new, o_new = merge_state(m_run, l_run, o_run, m_i, l_row, acc)
    m_run = tl.where(ends, m_new, m_run)
    l_run = tl.where(ends, l_new, l_run)
    o_run = tl.where(ends[:, None], o_new, o_run)
    m_i = tl.where(ends, float("-inf"), m_i)
    if DOT_SUM:
        l_i = tl.where(ends[:, None], 0.0, l_i)
    else:
        l_i = tl.where(ends, 0.0, l_i)
    acc = tl.where(ends[:, None], 0.0, acc)
    return m_i, l_i, acc, m_run, l_run, o_run


# stride_bt (the padded block-table width) varies from step to step: keep it out of specialisation so every
# step runs the same binary.
@triton.jit(do_not_specialize=["stride_bt", "slot_base", "num_heads"])
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    plan_ptr, qsl_ptr, pos_ptr, bt_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
    SWAP: tl.constexpr, FP16_KV: tl.constexpr, V_NAT: tl.constexpr, V_CVT: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, DOT_SUM: tl.constexpr = 0, PDL: tl.constexpr = 0,
    part_ptr=None, ml_ptr=None, soff_ptr=None, slot_base=0, num_heads=0,
    MIN_TILES: tl.constexpr = 1, MAX_SPLITS: tl.constexpr = 0, FIXED_SLOTS: tl.constexpr = False,
    ONE_TOKEN: tl.constexpr = False, MERGE_IN_PLACE: tl.constexpr = False,
):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    TOKEN_SPLITS: tl.constexpr = MAX_SPLITS > 0 and ONE_TOKEN       # one split layout per program (decode)
    MERGE: tl.constexpr = MAX_SPLITS > 0 and not ONE_TOKEN and MERGE_IN_PLACE   # a row's ranges, merged here
    ROW_SPLITS: tl.constexpr = MAX_SPLITS > 0 and not ONE_TOKEN and not MERGE_IN_PLACE   # one split per row
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(plan_ptr + 2 * pid)
    q_block = tl.load(plan_ptr + 2 * pid + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_start + tok < q_end)
    t = (q_start + tok).to(tl.int64)
    # Padding rows take position 0: finite arithmetic, never stored.
    q_pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int32)
    if TOKEN_SPLITS:
        # Split form of a decode step: the program's rows are one token's heads, so its split layout is one
        # scalar, and its tiles [lo, hi) all hold keys <= the position (lo * BLOCK_N <= p).
        tl.static_assert(not SWAP, "the split form runs the untransposed tile")
        split = tl.program_id(2)
        last_pos = tl.max(q_pos, axis=0)
        n_tiles, per_split, n_splits = split_layout(last_pos, BLOCK_N, MIN_TILES, MAX_SPLITS)
        if split >= n_splits:
            return   # past the token's last split (the static plan launches MAX_SPLITS per token)
        lo_pos = 0
        tile_lo = split * per_split
        num_tiles = tl.minimum(tile_lo + per_split, n_tiles)
    elif ROW_SPLITS:
        # This program reduces split tl.program_id(2) of each of its rows, whose layout follows from the
        # row's own position only.
        tl.static_assert(not SWAP, "the split form runs the untransposed tile")
        split = tl.program_id(2)
        n_tiles, per_split, n_splits = split_layout(q_pos, BLOCK_N, MIN_TILES, MAX_SPLITS)
        active = row_ok & (split < n_splits)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, n_tiles)
        lo_pos = lo * BLOCK_N
        # the row's keys in this split: [lo_pos, min(q_pos, hi * BLOCK_N - 1)]; none for an inactive row
        q_pos = tl.where(active, tl.minimum(q_pos, hi * BLOCK_N - 1), -1)
        last_pos = tl.max(q_pos, axis=0)     # -1 when no row of the program has keys in this split
        tile_lo = tl.where(last_pos >= 0, tl.min(tl.where(active, lo, 1 << 30), axis=0), 0)
        num_tiles = tl.where(last_pos >= 0, last_pos // BLOCK_N + 1, 0)
    else:
        lo_pos = 0
        tile_lo = 0
        last_pos = tl.max(q_pos, axis=0)
        num_tiles = last_pos // BLOCK_N + 1
    if MERGE:
        # Each row's own layout (padding rows, at position 0, take one range); the running merge of its
        # finished ranges starts empty, as the combine's does.
        tl.static_assert(not SWAP, "the split form runs the untransposed tile")
        row_tiles, per_split, n_splits = split_layout(q_pos, BLOCK_N, MIN_TILES, MAX_SPLITS)
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        o_run = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    if KV_FP8:  # e4m3 cache: the head's key scale folds into the score scale, its value scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if FP16_KV:
        q, row_inv = _row_pow2_scale(q)
        row_scale = row_inv * qk_scale       # exact: a power of two times the scalar
    else:
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * qk_scale

    # An exact x1 Triton cannot fold away (module docstring, V_CVT); unused (and dropped) otherwise.
    cvt_one = (tl.load(v_scale_ptr + kv_head) * 0.0 + 1.0).to(q.dtype)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if DOT_SUM:
        l_i = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([HEAD_DIM, BLOCK_M], dtype=tl.float32)
        q_t = tl.trans(q)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if PREFETCH:
        # The block ids of tile j + 1 are requested while tile j runs, so a tile's key/value loads never
        # wait on the block-table load of their own iteration (Triton's pipeliner then overlaps the key/
        # value copies with the products; left alone it serialises block ids -> copies -> products).
        block_next = _tile_blocks(bt_row, tile_lo, last_pos, BLOCK_N, BLOCK_SIZE)
    for j in range(tile_lo, num_tiles):
        kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH:
            block = block_next
            block_next = _tile_blocks(bt_row, j + 1, last_pos, BLOCK_N, BLOCK_SIZE)
        else:
            block = _tile_blocks(bt_row, j, last_pos, BLOCK_N, BLOCK_SIZE)
        k = _load_tile(k_base, block, j, last_pos, stride_kb, stride_ks, BLOCK_N, BLOCK_SIZE, HEAD_DIM)
        if SWAP:
            if KV_FP8:
                k = k.to(q.dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
            # S^T: keys down, query rows across; the softmax state of a row is its column's.
            if IEEE:
                s = tl.dot(k, q_t, input_precision="ieee")
            else:
                s = tl.dot(k, q_t)
            s = tl.where(kv_pos[:, None] <= q_pos[None, :], s * row_scale[None, :], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            # An unchanged max must rescale by exactly 1 (not by a hardware exp2 approximation of 2^0), so
            # tiles that are fully masked for a row leave its state bit-identical.
            alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if V_NAT:
                v = _load_tile(v_base, block, j, last_pos, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE,
                               HEAD_DIM)
                if KV_FP8:
                    v = v.to(q.dtype)
                    if V_CVT:
                        v = v * cvt_one
                v_t = tl.trans(v)
            else:
                offset = kv_pos % BLOCK_SIZE
                v_t = tl.load(v_base + block[None, :] * stride_vb + offset[None, :] * stride_vs
                              + d[:, None], mask=(kv_pos <= last_pos)[None, :], other=0.0)
                if KV_FP8:
                    v_t = v_t.to(q.dtype)
            acc = acc * alpha[None, :]
            if IEEE:
                acc = tl.dot(v_t, p.to(v_t.dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(v_t, p.to(v_t.dtype), acc)
            m_i = m_new
        else:
            v = _load_tile(v_base, block, j, last_pos, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE,
                           HEAD_DIM)
            m_i, l_i, acc = _tile_update(q, k, v, kv_pos, q_pos, row_scale, m_i, l_i, acc, cvt_one,
                                         IEEE, KV_FP8, V_CVT, DOT_SUM, lo_pos, ROW_SPLITS)
            if MERGE:
                # rows whose range ends at this tile and that have another range after it
                ends = ((j + 1) % per_split == 0) & (j + 1 < row_tiles)
                if tl.max(ends.to(tl.int32), axis=0) > 0:   # a scalar branch: most tiles end no range
                    m_i, l_i, acc, m_run, l_run, o_run = _fold_ended(ends, m_i, l_i, acc, m_run, l_run,
                                                                     o_run, DOT_SUM)
    if SWAP:
        out = acc / l_i[None, :]
        if KV_FP8:
            out = out * tl.load(v_scale_ptr + kv_head)
        tl.store(out_ptr + t[None, :] * stride_ot + head[None, :] * stride_oh + d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
    else:
        if DOT_SUM:
            l_i = tl.max(l_i, axis=1)    # every column holds the sum: max is exact and order-free
        if TOKEN_SPLITS:
            # The token's split count decides for all rows: a scalar branch keeps one store live at a time.
            if n_splits == 1:
                _store_out(out_ptr, acc / l_i[:, None], t, head, d, stride_ot, stride_oh, row_ok, v_scale_ptr,
                           kv_head, KV_FP8)
            else:
                _store_partial(part_ptr, ml_ptr, soff_ptr, t, head, d, split, slot_base, num_heads, acc, m_i,
                               l_i, row_ok, HEAD_DIM, MAX_SPLITS, FIXED_SLOTS)
        elif ROW_SPLITS:
            # A one-split row normalises and stores as the unsplit form does; the others leave their
            # split's state for kernels/split_combine.py (which applies an e4m3 cache's value scale).
            single = active & (n_splits == 1)
            out = acc / tl.where(single, l_i, 1.0)[:, None]
            multi = active & (n_splits > 1)
            _store_partial(part_ptr, ml_ptr, soff_ptr, t, head, d, split, slot_base, num_heads, acc, m_i, l_i,
                           multi, HEAD_DIM, MAX_SPLITS, FIXED_SLOTS)
            _store_out(out_ptr, out, t, head, d, stride_ot, stride_oh, single, v_scale_ptr, kv_head, KV_FP8)
        elif MERGE:
            # The last range folds in as the combine's last step; a row of one range normalises its own
            # state, as the one-program form (and the combine, which skips such rows) does.
            _, l_f, o_f = merge_state(m_run, l_run, o_run, m_i, l_i, acc)
            out = tl.where((n_splits > 1)[:, None], o_f / l_f[:, None], acc / l_i[:, None])
            _store_out(out_ptr, out, t, head, d, stride_ot, stride_oh, row_ok, v_scale_ptr, kv_head, KV_FP8)
        else:
            _store_out(out_ptr, acc / l_i[:, None], t, head, d, stride_ot, stride_oh, row_ok, v_scale_ptr,
                       kv_head, KV_FP8)
