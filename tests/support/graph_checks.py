"""The padded decode step of a CUDA-graph bucket, run eagerly on CPU: what every graph-capable model must
keep (tests/engine/test_graph_buckets.py for the dense K/V cache, test_deepseek_graphs.py for MLA's latent
cache)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs, is_decode_step

# One layer's cache -> its entries by slot ([num_slots, ...]): the tensor whose rows a step writes.
SlotRows = Callable[[object], torch.Tensor]


def check_padded_decode_step(llm: LLM, slot_rows: SlotRows) -> None:
    """Three sequences are prefilled, then their decode step is staged into the bucket of 4 and run
    eagerly through the graphs' static buffers (the padding row: token 0 at position 0, slot -1): the
    real rows' hidden states must be the eager step's bits and finite, the padding row must write no cache
    slot, and the eager step must write the same entries the padded one did."""
    engine = llm.engine
    prompts = [[5, 6, 7, 8], list(range(10, 40)), [9]]
    for i, p in enumerate(prompts):
        engine.add(llm._make_seq(i, p, SamplingParams(temperature=0.0, max_tokens=8)))
    engine.step()   # prefill all three
    out = engine.scheduler.schedule()
    assert is_decode_step(out) and len(out.scheduled) == 3
    runner = engine.runner
    bs = runner.block_size
    graphs = DecodeGraphs(runner.model, runner.kv_caches, bs, 512, 8, torch.device("cpu"))
    real_slots = {s.seq.block_table[s.start // bs] * bs + s.start % bs for s in out.scheduled}
    with torch.inference_mode():
        before = [slot_rows(c).clone() for c in runner.kv_caches]
        assert graphs.stage(out, [], None) == 4
        padded = graphs.forward_eagerly(4).clone()
        after_padded = [slot_rows(c).clone() for c in runner.kv_caches]
        eager = engine.executor.forward(out).hidden
    assert torch.equal(padded[:3], eager)
    assert torch.isfinite(padded).all()
    for old, new, cache in zip(before, after_padded, runner.kv_caches, strict=True):
        changed = set((old != new).flatten(1).any(-1).nonzero().flatten().tolist())
        assert changed and changed <= real_slots     # the padding row wrote no cache slot
        assert torch.equal(slot_rows(cache), new)    # the eager step wrote the same entries
    engine.abort_all()
