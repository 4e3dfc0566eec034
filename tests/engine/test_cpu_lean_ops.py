"""CpuInvariantOps' lean SiLU-and-mul and rotary + KV store give bitwise what the references they replace
give (kernels/reference/activation.py's fixed-path form; Ops' unfused rotate_half + store_kv)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.layers.rotary import RotaryEmbedding
from deepinfer.kernels.reference.activation import silu_and_mul_ref

INV = make_ops("cpu", deterministic=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("inter", [7, 64, 200, 1536])
def test_silu_and_mul_matches_the_fixed_path_reference(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * 1000 + inter)
    x = torch.randn(rows, 2 * inter, generator=gen) * torch.tensor([0.01, 1.0, 8.0, 40.0])[
        torch.randint(0, 4, (rows, 2 * inter), generator=gen)]
    x = x.to(dtype)
    x[0, :3] = torch.tensor([-100.0, 100.0, -0.0])   # saturating and signed-zero gates
    got = INV.silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(silu_and_mul_ref(x, invariant=True)))


def _qkv(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q, k, v as the attention layer makes them: views of one projection output [T, (hq + 2 hkv) d]."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d), v.reshape(tokens, hkv, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("negative_slot", [False, True])
def test_rotary_store_matches_the_unfused_composition(dtype, negative_slot):
    tokens, hq, hkv, d, bs, blocks = 19, 9, 3, 64, 16, 6
    q, k, v = _qkv(tokens, hq, hkv, d, dtype, seed=3)
    positions = torch.tensor([5, 900, 0, *range(1000, 1016)])
    cos, sin = RotaryEmbedding(d, 2048, 100000.0, None)(positions, dtype)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(4))[:tokens]
    if negative_slot:
        slots[2] = -1     # a padding token: not stored
    caches = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        caches.append([torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)])
    got = INV.rotary_store_kv(q, k, v, cos, sin, *caches[0], slots)
    want = Ops.rotary_store_kv(INV, q, k, v, cos, sin, *caches[1], slots)
    assert torch.equal(_bits(got), _bits(want))
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(_bits(a), _bits(b))
