"""WindowedBlockManager (engine/core/window_blocks.py): released window blocks, aux pool, bounded replay."""

from __future__ import annotations

import pytest
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.core.window_blocks import RELEASED, WindowedBlockManager
from deepinfer.engine.sample.params import SamplingParams

BS = 16


def make_seq(seq_id: int, n: int) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(n)), params=SamplingParams(), seed=seq_id)


def manager(num_blocks: int = 8, aux: int = 8, keep: int = 7, rate: int = 4, replay: int = 29):
    return WindowedBlockManager(num_blocks, BS, aux, keep_tokens=keep, entry_rate=rate, replay_span=replay)


def decode(bm: WindowedBlockManager, seq: Sequence, steps: int) -> list[int]:
    """Append one token per step, 'compute' it; return the window blocks held after each step."""
    held = []
    for _ in range(steps):
        seq.prompt_token_ids.append(0)
        assert bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        held.append(bm.window_blocks_held(seq))
        bm.check_invariants()
    return held


def test_window_blocks_are_released_and_reused_while_entries_grow():
    bm = manager()
    seq = make_seq(1, 40)
    assert bm.match_prefix(seq) == [] and bm.can_allocate(seq, 40, [])
    bm.allocate(seq, 40, [])
    seq.num_computed_tokens = 40
    assert len(seq.block_table) == 3 and len(seq.aux_block_table) == 1  # 10 entries of 4 tokens
    held = decode(bm, seq, 200)
    # keep 7 earlier positions + the new one: never more than ceil(8 / 16) + 1 blocks, however long.
    assert max(held) <= 2 and bm.window_blocks_per_seq == 2
    assert seq.block_table[:10] == [RELEASED] * 10
    assert len(seq.aux_block_table) == -(-(240 // 4) // BS)  # the entries are all kept
    assert bm.num_free_blocks >= 8 - 2
    bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.aux_block_table == []


def test_preemption_keeps_entries_and_replays_only_the_span():
    bm = manager()
    seq = make_seq(1, 100)
    bm.allocate(seq, 100, [])
    seq.num_computed_tokens = 100
    aux = list(seq.aux_block_table)
    bm.preempt(seq)
    assert seq.block_table == [] and seq.aux_block_table == aux and seq.aux_valid_tokens == 100
    stand_ins = bm.match_prefix(seq)
    start = len(stand_ins) * BS
    assert stand_ins == [RELEASED] * 4 and start == (100 - 29) // BS * BS  # 64: 36 tokens recomputed
    assert bm.can_allocate(seq, 100 - start, stand_ins)
    assert bm.allocate(seq, 100 - start, stand_ins) == 0  # recomputed, not cache hits
    assert seq.num_computed_tokens == start and seq.aux_block_table == aux
    assert seq.block_table[:4] == [RELEASED] * 4 and bm.window_blocks_held(seq) == 3
    bm.free(seq)
    bm.check_invariants()
    assert bm.match_prefix(seq) == [] and seq.aux_valid_tokens == 0


def test_short_preempted_sequences_restart_from_scratch_and_capacity_counts_both_pools():
    bm = manager(aux=2)
    seq = make_seq(1, 30)
    bm.allocate(seq, 30, [])
    seq.num_computed_tokens = 30
    bm.preempt(seq)  # 30 < replay span + a block: nothing worth keeping
    assert bm.match_prefix(seq) == [] and seq.aux_block_table == []
    # 2 aux blocks hold 32 entries = 128 tokens' worth (+ the 3 tokens of an unfinished entry).
    assert bm.token_capacity() == (2 * BS + 1) * 4 - 1
    long = make_seq(2, 200)
    assert not bm.can_allocate(long, 200, [])
    with pytest.raises(ValueError, match="prefix caching off"):
        bm.can_allocate(seq, 10, [3])


TINY_V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 24,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def test_capacity_planner_sizes_both_pools_from_the_bytes_per_sequence(tmp_path):
    import json

    import torch
    from deepinfer.engine import LLM
    from deepinfer.engine.layers.v4_cache import v4_cache_spec
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.demo import write_tokenizer_files

    (tmp_path / "config.json").write_text(json.dumps(TINY_V4_CONFIG))
    write_tokenizer_files(tmp_path)
    gib, length = 1 / 256, 512
    llm = LLM(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        load_format="dummy",
        cpu_kv_cache_gib=gib,
        enable_prefix_caching=False,
        max_model_len=length,
    )
    spec, n = llm.kv_cache_spec, llm.cache_cfg.num_blocks
    bm = llm.engine.scheduler.block_manager
    budget = int(gib * (1 << 30))
    assert spec.bounded and n == budget // spec.bytes_per_block and bm.num_aux_blocks == spec.aux_blocks(n)
    allocated = sum(
        w.numel() * w.element_size() + a.numel() * a.element_size() for w, a in llm.engine.runner.kv_caches
    )
    assert allocated <= budget + spec.aux_bytes_per_block
    # Sequences of max_model_len tokens the pools hold, each pool on its own: what budget / bytes per
    # sequence promises, within a sequence.
    per_seq_aux = -(-(length // spec.entry_rate) // BS)
    fits = min(n // spec.window_blocks_per_seq(), bm.num_aux_blocks // per_seq_aux)
    assert abs(fits - budget // spec.bytes_per_seq(length)) <= 1
    # Against the full layout (every token's rows kept) and a full-attention MQA cache (one K=V per token).
    cfg = ModelConfig.from_dict(TINY_V4_CONFIG)
    full = v4_cache_spec(cfg, BS, torch.float32)
    mqa = length * cfg.num_hidden_layers * cfg.head_dim * 4
    assert spec.bytes_per_seq(length) * 4 < full.bytes_per_seq(length)
    assert spec.bytes_per_seq(length) < mqa
    # A batch where no sequence has a compressed entry yet (3 tokens < the rate of 4) runs too.
    from deepinfer.engine import SamplingParams

    out = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 6
