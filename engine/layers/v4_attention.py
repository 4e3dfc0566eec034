"""DeepSeek-V4 attention over the paged token entries (transformers' DeepseekV4Attention).

Queries: q LoRA (q_a_proj -> q_a_norm -> q_b_proj), an unweighted per-head RMSNorm, partial rope. One shared
key = value head (kv_proj -> kv_norm -> rope). Each query attends to
- the sliding window: its own and the `window - 1` previous tokens' shared kv;
- CSA layers: the `index_topk` compressed entries (rate 4) its Lightning Indexer scores highest, among
  those whose window is complete at the query; HCA layers: every complete compressed entry (rate 128);
plus a learned per-head sink logit in the softmax denominator. The output's rope slice is rotated back by
the query's position (K = V carried the rotation into V), then the grouped low-rank output projection:
o_a_proj maps each of `o_groups` head groups to `o_lora_rank`, o_b_proj mixes the groups to hidden.
The attention over each token's key slots is `ops.v4_sink_attention`, the indexer's scores
`ops.v4_indexer_scores`: on CPU gathered plain torch (kernels/reference/v4_*.py), on CUDA Triton kernels
that read the cache rows by slot (kernels/v4_attention.py, kernels/v4_indexer.py).
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.hyper_connections import unweighted_rms_norm
from deepinfer.engine.layers.linear import Linear, empty_param
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.layers.v4_cache import entry_layout, entry_rate
from deepinfer.engine.layers.v4_compressor import LightningIndexer, WindowCompressor, slots_of
from deepinfer.engine.layers.v4_norm import V4RMSNorm
from deepinfer.engine.layers.v4_rope import V4Rotary, apply_v4_rotary
from deepinfer.engine.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.reference.attention import token_seq_index
from deepinfer.kernels.reference.v4_attention import sink_attention
from torch import nn

# Bounds what one piece of query tokens gathers (and, deterministic, multiplies elementwise) at once:
# 32 MiB of float32 on CPU, 16 times that on a GPU (fewer, larger launches). With ops that read the keys by
# slot (CUDA) only the Lightning Indexer's keys still count.
_PIECE_ELEMENTS = 1 << 23

__all__ = ["V4Attention", "sink_attention"]


class V4Attention(nn.Module):
    """Parameters named as transformers names them (q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj,
    o_b_proj, sinks, compressor.*, compressor.indexer.*)."""

    def __init__(
        self, cfg: DeepseekV4Config, layer: int, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.kind = cfg.layer_types[layer]
        self.layout = entry_layout(cfg, layer)
        h, d, hidden, eps = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.rms_norm_eps
        self.heads, self.head_dim, self.eps = h, d, eps
        self.q_a_proj = Linear(hidden, cfg.q_lora_rank, False, ops, dtype, device)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, eps, ops, device)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * d, False, ops, dtype, device)
        self.kv_proj = Linear(hidden, d, False, ops, dtype, device)
        self.kv_norm = V4RMSNorm(d, eps, ops, device)
        # o_a_proj.weight [o_groups * o_lora_rank, h * d / o_groups]: group g's rows are [g*R, (g+1)*R).
        self.o_a_proj = Linear(
            h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, False, ops, dtype, device
        )
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, hidden, False, ops, dtype, device)
        self.sinks = empty_param(h, dtype=torch.float32, device=device)
        self.rate, self.entry_rate = 0, entry_rate(cfg)
        if self.kind != SLIDING:
            self.rate = cfg.rate(self.kind)
            series = 2 if self.kind == CSA else 1
            self.compressor = WindowCompressor(hidden, d, self.rate, series, eps, ops, dtype, device)
            if self.kind == CSA:
                self.compressor.indexer = LightningIndexer(
                    hidden,
                    cfg.q_lora_rank,
                    cfg.index_n_heads,
                    cfg.index_head_dim,
                    self.rate,
                    cfg.index_topk,
                    eps,
                    ops,
                    dtype,
                    device,
                )

    def _storage(
        self, cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
        """(window rows, compressed rows, the tables that address compressed rows, whether they are
        entry-indexed): the full layout keeps both parts in one row per token, entry w in the row of token
        (w + 1) * rate - 1; the bounded one keeps entries in their own pool, entry w at index
        (w + 1) * rate / entry_rate - 1 (its closing token's index at the finest rate)."""
        lay = self.layout
        if isinstance(cache, tuple):
            window, aux = cache
            comp = aux.view(-1, lay.compressed_width) if self.rate else None
            tables = getattr(meta, "aux_block_tables", None)
            if tables is None:  # no sequence of the batch has a compressed entry yet: nothing to address
                tables = meta.block_tables.new_zeros((meta.num_seqs, 1))
            return window.view(-1, lay.window_width), comp, tables, True
        flat = cache.view(-1, lay.window_width + lay.compressed_width)
        return flat, flat[:, lay.window_width :], meta.block_tables, False

    def _entry_position(self, w: torch.Tensor, by_entry: bool) -> torch.Tensor:
        # Either way addressed by the token that closes window w: in the full layout its row, in the bounded
        # pool its index at the finest rate (so an aux block depends only on the tokens before its end).
        closing = (w + 1) * self.rate
        return closing // self.entry_rate - 1 if by_entry else closing - 1

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: V4Rotary,
        meta: AttentionMetadata,
        cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; this step's entries are written into `cache` before it is read."""
        t, h, d = x.shape[0], self.heads, self.head_dim
        lay, bs = self.layout, meta.block_size
        cos, sin = rope
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(t, h, d), self.eps, self.ops)
        q = apply_v4_rotary(q, cos, sin)
        kv = apply_v4_rotary(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin).squeeze(1)
        flat, comp, comp_tables, by_entry = self._storage(cache, meta)
        slots = meta.slot_mapping
        flat[slots, lay.swa] = kv.to(flat.dtype)
        seq_of = token_seq_index(meta, x.device)
        tables = meta.block_tables.to(torch.int64)[seq_of]  # [T, max_blocks]
        c = 0
        if self.rate:
            comp_tables = comp_tables.to(torch.int64)
            self._write_compressed(x, flat, comp, comp_tables, by_entry, meta, rotary)
            c = max(meta.seq_lens_cpu) // self.rate
            comp_tables = comp_tables[seq_of]
        # Query tokens are independent: attend in pieces whose gathered keys (and, in deterministic mode,
        # elementwise products) stay bounded, whatever the prompt length.
        chosen = c if self.kind != CSA else min(self.cfg.index_topk, c)
        det = self.ops.deterministic
        gathers = self.ops.v4_gathers_keys
        per_token = (self.cfg.window + chosen) * (d * (h if det else 1) if gathers else 1)
        if self.kind == CSA:  # the indexer's keys (products), or its scores [T, C] alone
            per_key = self.cfg.index_head_dim * (self.cfg.index_n_heads if det else 1)
            per_token += c * (per_key if gathers else 1)
        step = max(1, (_PIECE_ELEMENTS << (4 if x.is_cuda else 0)) // per_token)
        out = torch.empty_like(q)
        window_rows = flat[:, lay.swa]
        for a in range(0, t, step):
            sl = slice(a, a + step)
            sources = [(window_rows, *self._window_slots(tables[sl], positions[sl], bs))]
            if c:
                sources.append(self._compressed_source(
                    x[sl],
                    q_res[sl],
                    positions[sl],
                    (cos[sl], sin[sl]),
                    comp,
                    comp_tables[sl],
                    by_entry,
                    c,
                    bs,
                ))
            out[sl] = self.ops.v4_sink_attention(q[sl], sources, self.sinks, d**-0.5)
        out = apply_v4_rotary(out, cos, -sin)
        g, r = self.cfg.o_groups, self.cfg.o_lora_rank
        grouped = out.reshape(t, g, -1)
        w = self.o_a_proj.weight
        low = torch.cat(
            [self.ops.linear(grouped[:, i].contiguous(), w[i * r : (i + 1) * r]) for i in range(g)], dim=-1
        )
        return self.o_b_proj(low)

    def _window_slots(
        self, tables: torch.Tensor, positions: torch.Tensor, bs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, window] slots of the window's keys (oldest first) and their validity: positions
        max(0, p - window + 1) .. p. Invalid ones address the query's own row: a bounded cache may have
        released the blocks before."""
        win = self.cfg.window
        n = torch.clamp(positions + 1, max=win)  # [T]
        j = torch.arange(win, device=positions.device)
        valid = j[None, :] < n[:, None]
        pos = torch.where(valid, positions[:, None] - n[:, None] + 1 + j[None, :], positions[:, None])
        # A replay after preemption starts after released blocks (table entry < 0): never read those.
        valid = valid & (tables.gather(1, pos // bs) >= 0)
        pos = torch.where(valid, pos, positions[:, None])
        return slots_of(tables, pos, bs), valid

    def _write_compressed(
        self,
        x: torch.Tensor,
        flat: torch.Tensor,
        comp_rows: torch.Tensor,
        comp_tables: torch.Tensor,
        by_entry: bool,
        meta: AttentionMetadata,
        rotary: V4Rotary,
    ) -> None:
        """Store this step's compressor projections, then build every window this step completes."""
        lay, comp, slots = self.layout, self.compressor, meta.slot_mapping
        kv, gate = comp.project(x)
        flat[slots, lay.raw_kv], flat[slots, lay.raw_gate] = kv.to(flat.dtype), gate.to(flat.dtype)
        indexer = getattr(comp, "indexer", None)
        if indexer is not None:
            ikv, igate = indexer.project(x)
            flat[slots, lay.idx_raw_kv] = ikv.to(flat.dtype)
            flat[slots, lay.idx_raw_gate] = igate.to(flat.dtype)
        m = self.rate
        seqs, wins = [], []
        # Entries a preemption kept (core/window_blocks.py) are exact; a replay must not rewrite them.
        kept = getattr(meta, "aux_valid_tokens_cpu", None) or [0] * meta.num_seqs
        for b, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            first = max((slen - qlen) // m, kept[b] // m)
            seqs += [b] * (slen // m - first)
            wins += range(first, slen // m)
        if not wins:
            return
        dev = x.device
        rows = torch.tensor(seqs, device=dev)
        tables = meta.block_tables.to(torch.int64)[rows]  # [P, max_blocks]
        w = torch.tensor(wins, dtype=torch.int64, device=dev)
        span = comp.series * m  # CSA reads window w - 1 too (window 0's predecessor slots are masked)
        pos = (w[:, None] + 1) * m - span + torch.arange(span, device=dev)[None, :]  # [P, span]
        src = flat[slots_of(tables, pos.clamp(min=0), meta.block_size)]
        dst = slots_of(comp_tables[rows], self._entry_position(w, by_entry), meta.block_size)
        has_prev = w > 0
        for module, raw_kv, raw_gate, out in (
            (comp, lay.raw_kv, lay.raw_gate, lay.compressed),
            (indexer, lay.idx_raw_kv, lay.idx_raw_gate, lay.idx_compressed),
        ):
            if module is None:
                continue
            entries = module.compress(src[..., raw_kv], src[..., raw_gate], has_prev, w * m, rotary)
            comp_rows[dst, out] = entries.to(comp_rows.dtype)

    def _compressed_source(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        comp_rows: torch.Tensor,
        comp_tables: torch.Tensor,
        by_entry: bool,
        c: int,
        bs: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compressed entries each query attends to: (entry rows [S, D], slots [T, K], valid [T, K])."""
        lay = self.layout
        n_valid = (positions + 1) // self.rate  # [T]
        w = torch.arange(c, device=x.device)
        valid = w[None, :] < n_valid[:, None]
        # Entries a query may not see yet read entry 0's row (allocated by then or masked).
        where = torch.where(valid, w[None, :], 0)
        entry_slots = slots_of(comp_tables, self._entry_position(where, by_entry), bs)  # [T, C]
        indexer = getattr(self.compressor, "indexer", None)
        if indexer is None:
            return comp_rows[:, lay.compressed], entry_slots, valid
        cos, sin = rope
        ikeys = (comp_rows[:, lay.idx_compressed], entry_slots, valid)
        ids, chosen = indexer.select(x, q_res, cos, sin, ikeys, n_valid)
        return comp_rows[:, lay.compressed], entry_slots.gather(1, ids), chosen
