"""CPU ops backends: the deterministic ops are bitwise batch-invariant, and both backends are correct."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from deepinfer.engine.layers.backends import make_ops
from deepinfer.kernels.metadata import KV_CHUNK, AttentionMetadata
from deepinfer.kernels.reference.attention import chunked_paged_attention, paged_attention_ref
from deepinfer.kernels.reference.pointwise import PIECE, fixed_path

INV = make_ops("cpu", deterministic=True)
FAST = make_ops("cpu", deterministic=False)


def _rows_invariant(fn, x: torch.Tensor, rows: list[int]) -> None:
    """fn(x)[i] is bitwise fn(x[i:i+1])[0], and fn on a batch with other rows appended agrees too."""
    full = fn(x)
    extended = fn(torch.cat([x, torch.randn_like(x[:3]) * 3]))
    for i in rows:
        alone = fn(x[i:i + 1])[0]
        assert torch.equal(full[i], alone), f"row {i} of {x.shape[0]} differs when computed alone"
        assert torch.equal(extended[i], alone)


def test_make_ops_picks_backend_by_device_and_mode():
    assert INV.deterministic and not FAST.deterministic
    with pytest.raises(ValueError, match="cuda' or 'cpu"):
        make_ops("meta", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 128), (72, 40), (100, 257)])  # 72*2 bytes: chunk starts misaligned
@pytest.mark.parametrize("m", [1, 31, 33, 70])
def test_linear_rows_are_batch_invariant(dtype, k, n, m):
    gen = torch.Generator().manual_seed(k * n + m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    _rows_invariant(lambda t: INV.linear(t, w, b), x, sorted({0, m // 2, m - 1}))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(INV.linear(x, w, b), F.linear(x, w, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 64, 4096, 8192])
def test_rms_norm_rows_are_batch_invariant_and_match_hf(dtype, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    _rows_invariant(lambda t: INV.rms_norm(t, w, 1e-6), x, [0, 17, 36])
    ref = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
        expected = ref(x)
    for ops in (INV, FAST):
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), expected, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_returns_norm_of_sum_and_the_sum():
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64)
    out, summed = INV.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, r + x)
    assert torch.equal(out, INV.rms_norm(r + x, w, 1e-6))
    out0, summed0 = INV.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(summed0, x) and torch.equal(out0, INV.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 40: rows end mid-vector; 1000: 53 rows exceed torch's parallel grain, so threads split rows at odd offsets
@pytest.mark.parametrize("inter", [40, 1000])
def test_silu_and_mul_rows_are_batch_invariant(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(53, 2 * inter, generator=gen) * 4).to(dtype)
    _rows_invariant(INV.silu_and_mul, x, list(range(53)))
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    for ops in (INV, FAST):
        rtol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ops.silu_and_mul(x), expected, atol=1e-6, rtol=rtol)


def test_fixed_path_gives_each_element_one_result_whatever_the_tensor_size():
    x = torch.randn(3 * PIECE + 77) * 6
    full = fixed_path(F.silu, x)
    for start, length in [(0, 1), (5, 3), (PIECE - 2, 5), (2 * PIECE + 13, 64), (len(x) - 9, 9)]:
        assert torch.equal(fixed_path(F.silu, x[start:start + length]), full[start:start + length])
    torch.testing.assert_close(full, F.silu(x))


def _paged_batch(seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, head_dim: int, seed: int):
    """Random paged caches holding sequences of (context_len, new_tokens) and matching metadata."""
    rng = random.Random(seed)
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 2
    free = rng.sample(range(num_blocks), num_blocks)
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables, slots, positions = [], [], []
    for ctx, new in seqs:
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(blocks)
        for p in range(ctx - new, ctx):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in tables)
    qlens, slens = [n for _, n in seqs], [c for c, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), positions=torch.tensor(positions),
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size, max_query_len=max(qlens), max_seq_len=max(slens),
        query_lens_cpu=qlens, seq_lens_cpu=slens,
    )
    return k_cache, v_cache, meta


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_chunked_attention_matches_plain_attention(block_size, heads):
    hq, hkv = heads
    seqs = [(37, 37), (5, 1), (70, 20), (16, 16), (17, 1)]
    k_cache, v_cache, meta = _paged_batch(seqs, block_size, hkv, 16, seed=block_size + hq)
    q = torch.randn(meta.num_tokens, hq, 16, generator=torch.Generator().manual_seed(1))
    out = chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25),
                               atol=1e-5, rtol=1e-5)


def test_chunked_attention_token_result_is_independent_of_batch_and_split():
    """The same query at the same position over the same cache: bitwise equal in any batch layout."""
    hq, hkv, d = 4, 2, 16
    k_cache, v_cache, meta = _paged_batch([(50, 50)], 16, hkv, d, seed=7)
    q = torch.randn(50, hq, d, generator=torch.Generator().manual_seed(2))
    ref = chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    table = meta.block_tables[0].tolist()
    for lo, hi in [(0, 1), (15, 17), (33, 50), (49, 50)]:
        # The target sequence's tokens [lo, hi) beside a long and a short unrelated sequence.
        other_k, other_v, other = _paged_batch([(90, 90), (3, 1)], 16, hkv, d, seed=hi)
        n_own = k_cache.shape[0]
        k_all, v_all = torch.cat([k_cache, other_k]), torch.cat([v_cache, other_v])
        tables = [table, [b + n_own for b in other.block_tables[0].tolist()],
                  [b + n_own for b in other.block_tables[1].tolist()]]
        width = max(len(t) for t in tables)
        qlens, slens = [hi - lo, 90, 1], [hi, 90, 3]
        positions = torch.cat([torch.arange(lo, hi), other.positions])
        meta2 = AttentionMetadata(
            slot_mapping=torch.zeros(len(positions), dtype=torch.int64), positions=positions,
            query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(slens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            block_size=16, max_query_len=90, max_seq_len=90, query_lens_cpu=qlens, seq_lens_cpu=slens,
        )
        q2 = torch.cat([q[lo:hi], torch.randn(91, hq, d)])
        out = chunked_paged_attention(q2, k_all, v_all, meta2, 0.25)
        assert torch.equal(out[: hi - lo], ref[lo:hi])


def test_chunked_attention_ignores_nan_in_slots_past_the_position():
    k_cache, v_cache, meta = _paged_batch([(20, 20)], 16, 2, 16, seed=3)
    q = torch.randn(20, 4, 16)
    ref = chunked_paged_attention(q, k_cache, v_cache, meta, 0.25)
    block = meta.block_tables[0, 1].item()
    k_cache[block, 4:], v_cache[block, 4:] = float("nan"), float("nan")  # positions 20..31: never read
    assert torch.equal(chunked_paged_attention(q, k_cache, v_cache, meta, 0.25), ref)


def test_chunked_attention_rejects_block_size_not_multiple_of_kv_chunk():
    k_cache, v_cache, meta = _paged_batch([(8, 8)], 8, 2, 16, seed=0)
    with pytest.raises(ValueError, match=f"multiple of KV_CHUNK={KV_CHUNK}"):
        chunked_paged_attention(torch.randn(8, 4, 16), k_cache, v_cache, meta, 0.25)


def test_store_kv_writes_each_token_at_its_slot():
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    INV.store_kv(k, v, k_cache, v_cache, torch.tensor([5, 16, 63]))
    assert torch.equal(k_cache[0, 5], k[0]) and torch.equal(k_cache[1, 0], k[1])
    assert torch.equal(v_cache[3, 15], v[2])
    assert k_cache.count_nonzero() == k.count_nonzero()
