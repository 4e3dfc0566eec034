"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams instead of one.

transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead. Before a block, the streams [T, N, H] give
(from their flattened, unweighted-RMS-normed values through one float32 projection) three mixings: `pre`
collapses the streams into the block's input, `post` spreads the block's output back over the streams, and
`comb` (made doubly stochastic by Sinkhorn-Knopp iterations) mixes the input streams into the output ones:
streams' = post * block(pre . streams) + comb^T @ streams. Parameters stay float32, as the reference keeps
them. Every op here is row-local (a token's mixing depends only on its own streams); `invariant` puts the
transcendental functions on one fixed code path and the projection through the row-invariant `Ops.linear`.
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import empty_param
from deepinfer.engine.layers.ops import Ops
from deepinfer.kernels.reference.pointwise import fixed_path
from torch import nn


def _fn(ops: Ops, f, x: torch.Tensor) -> torch.Tensor:
    return fixed_path(f, x) if ops.deterministic else f(x)


def unweighted_rms_norm(x: torch.Tensor, eps: float, ops: Ops) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (transformers' DeepseekV4UnweightedRMSNorm)."""
    inv = _fn(ops, torch.rsqrt, x.float().square().mean(-1, keepdim=True) + eps)
    return x * inv.to(x.dtype)


class HyperConnection(nn.Module):
    """`fn` [(2 + N) * N, N * H], `base` [(2 + N) * N], `scale` [3], all float32 (transformers' names)."""

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        ops: Ops,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps, self.ops = (
            n,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
            ops,
        )
        self.fn = empty_param((2 + n) * n, n * hidden_size, dtype=torch.float32, device=device)
        self.base = empty_param((2 + n) * n, dtype=torch.float32, device=device)
        self.scale = empty_param(3, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, H] -> (post [T, N], comb [T, N, N], block input [T, H]); mixings float32."""
        n, ops = self.hc_mult, self.ops
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps, ops)
        mixes = ops.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = _fn(ops, torch.sigmoid, pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * _fn(ops, torch.sigmoid, post_w * post_s + post_b)
        logits = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        e = _fn(ops, torch.exp, logits)
        comb = e / _sum(e, -1).unsqueeze(-1) + self.hc_eps
        comb = comb / (_sum(comb, -2).unsqueeze(-2) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (_sum(comb, -1).unsqueeze(-1) + self.hc_eps)
            comb = comb / (_sum(comb, -2).unsqueeze(-2) + self.hc_eps)
        collapsed = _sum(pre.unsqueeze(-1) * streams, 1).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """post * block_out + comb^T @ streams, [T, N, H], in the streams' dtype (as the reference mixes)."""
    dtype = streams.dtype
    combt = comb.to(dtype).transpose(-1, -2)  # [T, N(out), N(in)]
    mixed = combt[:, :, 0, None] * streams[:, None, 0]
    for j in range(1, streams.shape[1]):
        mixed = mixed + combt[:, :, j, None] * streams[:, None, j]
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams: `hc_fn` [N, N * H], `hc_base` [N], `hc_scale` [1] (float32)."""

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        hc_eps: float,
        norm_eps: float,
        ops: Ops,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps, self.ops = hc_eps, norm_eps, ops
        self.hc_fn = empty_param(hc_mult, hc_mult * hidden_size, dtype=torch.float32, device=device)
        self.hc_base = empty_param(hc_mult, dtype=torch.float32, device=device)
        self.hc_scale = empty_param(1, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H] -> [T, H] in the streams' dtype."""
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps, self.ops)
        mixes = self.ops.linear(flat, self.hc_fn)
        pre = _fn(self.ops, torch.sigmoid, mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return _sum(pre.unsqueeze(-1) * streams, 1).to(streams.dtype)


def _sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over a short dim term by term, left to right (a fixed order, whatever the batch)."""
    parts = x.unbind(dim)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total
