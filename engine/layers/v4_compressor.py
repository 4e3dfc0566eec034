"""DeepSeek-V4's KV compressors and Lightning Indexer over the paged token entries (layers/v4_cache.py).

A compressor turns every window of `rate` tokens into one entry: a per-channel softmax over the window's
gates (+ a learned per-offset `position_bias`) weights the tokens' projected kv, then RMSNorm and the
compress rope at the window's first position (transformers' DeepseekV4HCACompressor). CSA's windows overlap
(DeepseekV4CSACompressor): each token projects two series, and entry w mixes series a of window w - 1 with
series b of window w over 2 * rate slots (window 0 has no predecessor: those slots get weight 0).

Entry w can be built once its last token (w + 1) * rate - 1 is computed; it is stored at that token's slot.
So whether a sequence arrives in one prefill, in chunks, from the prefix cache or one decode token at a
time, every entry is computed once from the same tokens: scheduling never changes a value.
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import Linear, empty_param
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.layers.v4_norm import V4RMSNorm
from deepinfer.engine.layers.v4_rope import V4Rotary, apply_v4_rotary
from deepinfer.kernels.reference.pointwise import fixed_path
from torch import nn


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` [N, ...] given each row's block table `tables` [N, max_blocks]."""
    flat = positions.reshape(positions.shape[0], -1).clamp(min=0)
    blocks = tables.gather(1, flat // block_size)
    return (blocks * block_size + flat % block_size).view(positions.shape)


def _sum_dim1(x: torch.Tensor) -> torch.Tensor:
    total = x[:, 0]
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total


class WindowCompressor(nn.Module):
    """`kv_proj`, `gate_proj` (hidden -> series * dim), `position_bias` [rate, series * dim], `kv_norm`."""

    def __init__(
        self,
        hidden: int,
        dim: int,
        rate: int,
        series: int,
        eps: float,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.dim, self.rate, self.series, self.ops = dim, rate, series, ops
        self.kv_proj = Linear(hidden, series * dim, False, ops, dtype, device)
        self.gate_proj = Linear(hidden, series * dim, False, ops, dtype, device)
        self.position_bias = empty_param(rate, series * dim, dtype=torch.float32, device=device)
        self.kv_norm = V4RMSNorm(dim, eps, ops, device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token projections [T, series * dim] (kv, gate) a window is later compressed from."""
        return self.kv_proj(x), self.gate_proj(x)

    def compress(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        has_prev: torch.Tensor,
        positions: torch.Tensor,
        rotary: V4Rotary,
    ) -> torch.Tensor:
        """Entries of P windows: kv, gate [P, series * rate, series * dim] (CSA: window w - 1's tokens, then
        window w's; for HCA: window w's), has_prev bool [P] (CSA: w > 0), positions [P] = w * rate."""
        d, r = self.dim, self.rate
        bias = self.position_bias
        if self.series == 1:
            slot_kv, slot_gate = kv.float(), gate.float() + bias
        else:
            prev_ok = has_prev[:, None, None]
            kv_a = torch.where(prev_ok, kv[:, :r, :d].float(), 0.0)
            gate_a = torch.where(prev_ok, gate[:, :r, :d].float() + bias[:, :d], float("-inf"))
            slot_kv = torch.cat([kv_a, kv[:, r:, d:].float()], dim=1)  # [P, 2r, d]
            slot_gate = torch.cat([gate_a, gate[:, r:, d:].float() + bias[:, d:]], dim=1)
        m = slot_gate.amax(dim=1, keepdim=True)
        e = fixed_path(torch.exp, slot_gate - m) if self.ops.deterministic else torch.exp(slot_gate - m)
        weights = e / _sum_dim1(e).unsqueeze(1)
        pooled = _sum_dim1(slot_kv * weights).to(kv.dtype)  # [P, d]
        normed = self.kv_norm(pooled)
        cos, sin = rotary(positions, kv.dtype)
        return apply_v4_rotary(normed.unsqueeze(1), cos, sin).squeeze(1)


class IndexerScorer(nn.Module):
    def __init__(
        self, hidden: int, heads: int, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, False, ops, dtype, device)


class LightningIndexer(WindowCompressor):
    """CSA's indexer: its own overlapping compressor at index_head_dim, `q_b_proj` from the query LoRA, and
    `scorer.weights_proj`; scores sum_h w_h * relu(q_h . k) over the compressed keys and keeps the top k."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        dim: int,
        rate: int,
        topk: int,
        eps: float,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__(hidden, dim, rate, 2, eps, ops, dtype, device)
        self.heads, self.topk = heads, topk
        self.q_b_proj = Linear(q_lora_rank, heads * dim, False, ops, dtype, device)
        self.scorer = IndexerScorer(hidden, heads, ops, dtype, device)

    def select(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        n_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query token, its top-k compressed entries among the first n_valid [T].

        keys: (indexer key rows [S, dim], slots [T, C], valid [T, C]): the token's first C compressed
        indexer keys (those past n_valid are padding). Returns (entry ids [T, K] ascending with the chosen
        ones first, chosen mask [T, K]); K = min(topk, C).
        """
        t = x.shape[0]
        q = apply_v4_rotary(self.q_b_proj(q_res).view(t, self.heads, self.dim), cos, sin)
        w = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, H]
        # [T, C]: sum_h w_h * relu(q_h . k) * dim^-0.5, heads in a fixed order, -inf past n_valid.
        rows, slots, valid = keys
        total = self.ops.v4_indexer_scores(q, w, rows, slots, valid, self.dim**-0.5)
        c = slots.shape[1]
        k = min(self.topk, c)
        ids = torch.topk(total, k, dim=-1).indices
        chosen = ids < n_valid[:, None]
        # Chosen entries first, ascending: the attention then sums them in an order fixed by the token alone.
        ids = torch.where(chosen, ids, c).sort(dim=-1).values
        chosen = ids < n_valid[:, None]
        return ids.clamp(max=max(c - 1, 0)), chosen
