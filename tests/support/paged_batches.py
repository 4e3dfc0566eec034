"""Builders of paged-attention batches for the kernel tests and benchmarks (no Triton needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from deepinfer.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of a step: its KV blocks, its context length after the step, its new tokens
    (the last `query_len` positions of that context)."""

    blocks: Sequence[int]
    context_len: int
    query_len: int

    def __post_init__(self) -> None:
        if not 0 <= self.query_len <= self.context_len:
            raise ValueError(
                f"SeqStep: query_len={self.query_len} must be in [0, context_len={self.context_len}]"
            )


def random_block_lists(context_lens: Sequence[int], block_size: int, seed: int = 0,
                       spare_blocks: int = 3) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled KV block ids for sequences of the given lengths; returns (lists, num_blocks).

    Block 0 is never handed out (block tables are padded with 0), and `spare_blocks` extra blocks stay
    unused, so a kernel reading the wrong block reads garbage the tests can see.
    """
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    lists, start = [], 0
    for n in need:
        lists.append(ids[start:start + n])
        start += n
    return lists, num_blocks


def build_metadata(steps: Sequence[SeqStep], block_size: int, device: torch.device | str = "cpu"
                   ) -> AttentionMetadata:
    """AttentionMetadata for one step made of `steps` (sequence-major order, as the model runner builds)."""
    max_blocks = max(1, max(len(s.blocks) for s in steps))
    tables = torch.zeros((len(steps), max_blocks), dtype=torch.int32)
    slots, positions, qsl = [], [], [0]
    for b, s in enumerate(steps):
        if len(s.blocks) * block_size < s.context_len:
            raise ValueError(f"step {b}: {len(s.blocks)} blocks cannot hold {s.context_len} positions")
        tables[b, :len(s.blocks)] = torch.tensor(list(s.blocks), dtype=torch.int32)
        for p in range(s.context_len - s.query_len, s.context_len):
            positions.append(p)
            slots.append(s.blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + s.query_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s.context_len for s in steps], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        block_size=block_size,
        max_query_len=max(s.query_len for s in steps),
        max_seq_len=max(s.context_len for s in steps),
        query_lens_cpu=[s.query_len for s in steps],
        seq_lens_cpu=[s.context_len for s in steps],
    )


def gather_rows(per_seq: Sequence[torch.Tensor], steps: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Concatenate per_seq[b][start:end] for each (b, start, end): the step's query rows in order."""
    return torch.cat([per_seq[b][start:end] for b, start, end in steps], dim=0)


def rows_by_position(full: torch.Tensor, lens: Sequence[int]) -> dict[tuple[int, int], torch.Tensor]:
    """A full prefill's output rows (sequences back to back, lens[b] rows each) by (sequence, position)."""
    starts = [sum(lens[:b]) for b in range(len(lens))]
    return {(b, p): full[starts[b] + p] for b, n in enumerate(lens) for p in range(n)}


def check_rows_bitwise(want: dict[tuple[int, int], torch.Tensor], rows: Sequence[tuple[int, int, int]],
                       out: torch.Tensor, label: str) -> None:
    """`out` holds one row per position lo .. ctx - 1 of each (sequence, lo, ctx) of `rows`, in order; each
    must be bitwise want[(sequence, position)] (`rows_by_position` of a full prefill)."""
    i = 0
    for b, lo, ctx in rows:
        for p in range(lo, ctx):
            assert torch.equal(out[i], want[(b, p)]), f"{label}: seq {b} position {p}"
            i += 1


def padded_decode_metadata(blocks: Sequence[Sequence[int]], positions: Sequence[int], bucket: int,
                           block_size: int, device: torch.device | str = "cpu"
                           ) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A decode step of real rows (row i: the token at positions[i] of the sequence holding blocks[i])
    padded to `bucket` rows by the engine's own rules (engine/runner/input_buffers.py: position 0, slot -1,
    context 1, a block table of zeros), in two forms: (eager, graph). eager: the true host lengths and no
    decode plan (as an eager step of `bucket` rows: the kernels plan on the host); graph: the static
    buffers' views with placeholder host lengths and the decode plan, as a captured graph holds them
    (`graph_metadata`)."""
    from deepinfer.engine.runner.input_buffers import (
        DecodeRow,
        StaticDecodeBuffers,
        graph_metadata,
        pad_decode,
    )

    dev = torch.device(device)
    step = pad_decode([DecodeRow(0, p, list(b)) for p, b in zip(positions, blocks, strict=True)], bucket,
                      block_size)
    buf = StaticDecodeBuffers(bucket, step.block_tables.shape[1], dev)
    buf.load(step)
    graph = graph_metadata(buf, bucket, block_size)
    eager = AttentionMetadata(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(dev),
        positions=torch.from_numpy(step.positions).to(dev),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.from_numpy(step.seq_lens).to(dev),
        block_tables=torch.from_numpy(step.block_tables).to(dev),
        block_size=block_size, max_query_len=1, max_seq_len=int(step.seq_lens.max()),
        query_lens_cpu=[1] * bucket, seq_lens_cpu=step.seq_lens.tolist(),
    )
    return eager, graph


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float tensors (NaN payloads and the sign of zero included)."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@dataclass(frozen=True)
class FilledStep:
    """A step over NaN-filled float32 caches (unwritten slots show up as NaN) holding every context."""

    meta: AttentionMetadata      # the step: each sequence's last query_len positions
    fill: AttentionMetadata      # every position of every context (what was stored)
    k: torch.Tensor              # [fill tokens, Hkv, D] the stored keys
    v: torch.Tensor
    k_cache: torch.Tensor        # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


def filled_step(lens: Sequence[tuple[int, int]], block_size: int, num_kv_heads: int, head_dim: int,
                gen: torch.Generator, table_seed: int, key_scale: float = 1.0) -> FilledStep:
    """Sequences of (context, new tokens) `lens` on random disjoint blocks, random keys (times key_scale)
    and values stored at every context position."""
    from deepinfer.kernels.reference.store_kv import store_kv_ref

    tables, nb = random_block_lists([c for c, _ in lens], block_size, seed=table_seed)
    meta = build_metadata([SeqStep(b, c, q) for b, (c, q) in zip(tables, lens, strict=True)], block_size)
    fill = build_metadata([SeqStep(b, c, c) for b, (c, _) in zip(tables, lens, strict=True)], block_size)
    k = torch.randn(fill.num_tokens, num_kv_heads, head_dim, generator=gen) * key_scale
    v = torch.randn(fill.num_tokens, num_kv_heads, head_dim, generator=gen)
    kc = torch.full((nb, block_size, num_kv_heads, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    store_kv_ref(k, v, kc, vc, fill.slot_mapping)
    return FilledStep(meta, fill, k, v, kc, vc)


def host_step_of(meta: AttentionMetadata):
    """The engine's host arrays (engine/runner/host_step.HostStep) of a step built by `build_metadata`, for
    padding it as a CUDA-graph prefill step (input ids zero: attention never reads them)."""
    import numpy as np
    from deepinfer.engine.runner.host_step import HostStep

    host = {k: getattr(meta, k).cpu().numpy() for k in ("positions", "slot_mapping", "block_tables")}
    return HostStep(np.zeros(meta.num_tokens, dtype=np.int64), host["positions"], host["slot_mapping"],
                    list(meta.query_lens_cpu), list(meta.seq_lens_cpu), host["block_tables"], [])


def e4m3_copy(st: FilledStep, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 cache pair (NaN where nothing was stored) holding `st`'s keys/values quantized per kv head by
    the reference store (kernels/reference/kv_fp8.py)."""
    from deepinfer.kernels.reference.kv_fp8 import store_kv_fp8_ref

    k8 = torch.full_like(st.k_cache, float("nan")).to(torch.float8_e4m3fn)
    v8 = k8.clone()
    store_kv_fp8_ref(st.k, st.v, k8, v8, st.fill.slot_mapping, k_scale, v_scale)
    return k8, v8


def float32_and_e4m3_step(lens: Sequence[tuple[int, int]], block_size: int, num_q_heads: int,
                          num_kv_heads: int, head_dim: int, seed: int, table_seed: int) -> dict:
    """A `filled_step` (keys x3) with an e4m3 copy of its cache (k/v scales 0.05, 0.3 / 0.01, 0.02 for two kv
    heads, else 0.05 / 0.01) and bf16-representable float32 q ([T, Hq, D], x2): st, q, k8, v8, ks, vs."""
    gen = torch.Generator().manual_seed(seed)
    st = filled_step(lens, block_size, num_kv_heads, head_dim, gen, table_seed=table_seed, key_scale=3)
    if num_kv_heads == 2:
        ks, vs = torch.tensor([0.05, 0.3]), torch.tensor([0.01, 0.02])
    else:
        ks, vs = torch.full((num_kv_heads,), 0.05), torch.full((num_kv_heads,), 0.01)
    k8, v8 = e4m3_copy(st, ks, vs)
    q = (torch.randn(st.meta.num_tokens, num_q_heads, head_dim, generator=gen) * 2).to(torch.bfloat16).float()
    return dict(st=st, q=q, k8=k8, v8=v8, ks=ks, vs=vs)
