"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on a tiny random checkpoint (float32, CPU).

The checkpoint (tests/support/tiny_deepseek_v4.py) is built and saved by transformers' own classes: window 8,
CSA every 4 tokens (indexer top-3), HCA every 8, so prompts of 20-60 tokens cross the window many times and
close many compressed windows. Skipped when the installed transformers has no DeepSeek-V4.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.layers.v4_cache import v4_cache_spec
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.engine.models.loader import iter_weights
from deepinfer.engine.models.registry import build_model

from tests.support.hf_parity import check_chunked_prefill_and_decode, cpu_engine_model, random_prompts
from tests.support.tiny_deepseek_v4 import WINDOW, hf_v4_available, load_hf_v4, make_tiny_deepseek_v4

pytestmark = pytest.mark.skipif(
    not hf_v4_available(), reason="transformers has no DeepseekV4 (needs >= 5.2x)"
)

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny_v4") / "v4")


@pytest.fixture(scope="module")
def hf(ckpt):
    model = load_hf_v4(ckpt)
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            with torch.no_grad():
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                )
            memo[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return memo[tuple(prompt)]

    model.greedy = greedy
    return model


def test_config_reads_layer_types_rates_ropes_and_mtp(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert isinstance(cfg, DeepseekV4Config)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA) and cfg.rate(CSA) == 4 and cfg.rate(HCA) == 8
    assert (cfg.window, cfg.hc_mult, cfg.index_topk, cfg.num_mtp_layers) == (WINDOW, 2, 3, 1)
    assert cfg.main_rope.yarn is None and cfg.main_rope.rope_dim == 8 and cfg.compress_rope.theta == 160000.0
    assert cfg.compress_rope.yarn is not None and cfg.compress_rope.cos_sin_scale == 1.0
    assert cfg.sliding_window is None  # V4 is exact at any length; the window bounds one branch only


def test_legacy_keys_and_invalid_configs():
    raw = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": 24,
        "compress_ratios": [0, 4, 128],
        "num_hash_layers": 1,
        "qk_rope_head_dim": 8,
        "o_groups": 2,
    }
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types == (SLIDING, CSA, HCA) and cfg.mlp_layer_types == ("hash_moe", "moe", "moe")
    assert cfg.main_rope.rope_dim == 8
    with pytest.raises(ValueError, match="set it to 1"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        ModelConfig.from_dict({**raw, "layer_types": [SLIDING, CSA]})
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_dict({**raw, "scoring_func": "relu"})


def test_compress_yarn_matches_transformers(hf):
    from deepinfer.engine.layers.v4_rope import V4Rotary

    cfg = DeepseekV4Config.from_dict({**hf.config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    rot = hf.model.rotary_emb
    for ours, label in ((cfg.main_rope, "main"), (cfg.compress_rope, "compress")):
        assert torch.equal(V4Rotary(ours, invariant=False).inv_freq, getattr(rot, f"{label}_inv_freq"))
        assert ours.cos_sin_scale == getattr(rot, f"{label}_attention_scaling")


@pytest.mark.parametrize("deterministic", [True, False])
def test_prefill_chunks_and_decode_logits_match_hf(deterministic, ckpt, hf):
    """Two sequences (one prefilled in three chunks), then batched decode steps: every row within 1e-4."""
    cfg, model = cpu_engine_model(ckpt, deterministic)
    a, b = random_prompts(2, cfg.vocab_size, seed=3, lo=30, hi=50)
    check_chunked_prefill_and_decode(model, cfg, hf, a, b, [13, 6, len(a) - 19], steps=10)


def test_single_request_greedy_matches_hf_generate(ckpt, hf):
    llm = LLM(model=str(ckpt), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = random_prompts(1, llm.model_config.vocab_size, seed=1, lo=45, hi=45)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == hf.greedy(prompt)


SETTINGS = {
    # Blocks of 4 tokens: bounded-cache hits come in steps of block_size * 4 tokens (core/window_blocks.py).
    "prefix_cache": dict(num_kv_blocks=512, block_size=4),
    "chunked_prefill": dict(num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=8),
    "preemption": dict(num_kv_blocks=24, max_num_seqs=16),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_thirty_mixed_requests_match_hf(setting, ckpt, hf):
    llm = LLM(model=str(ckpt), device="cpu", dtype="float32", **SETTINGS[setting])
    prompts = random_prompts(30, llm.model_config.vocab_size, seed=2, shared_prefix=20)
    if setting == "prefix_cache":  # one earlier request leaves the shared prefix's first block cached
        llm.generate([prompts[0][:17]], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf.greedy(p)
    if setting == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the setting must force preemption"
    if setting == "prefix_cache":
        assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0, "shared prefixes must hit the cache"


def test_batch_invariant_in_deterministic_mode(ckpt):
    """Sampled requests alone and inside batches scheduled three ways: bitwise equal tokens and logprobs."""
    path = str(ckpt)
    alone = LLM(model=path, device="cpu", dtype="float32", num_kv_blocks=128)
    prompts = random_prompts(8, alone.model_config.vocab_size, seed=4, shared_prefix=18, lo=10, hi=40)
    params = [
        SamplingParams(temperature=0.9, seed=100 + i, max_tokens=8, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    ref = {i: alone.generate([prompts[i]], params[i], use_tqdm=False)[0] for i in (0, 7)}
    for kwargs in (
        dict(num_kv_blocks=128, max_num_batched_tokens=19, max_num_seqs=5),
        dict(num_kv_blocks=14, max_num_seqs=8),
        dict(num_kv_blocks=6, max_num_seqs=8, enable_prefix_caching=False, max_model_len=256),  # bounded
    ):
        outs = LLM(model=path, device="cpu", dtype="float32", **kwargs).generate(
            prompts, params, use_tqdm=False
        )
        for i, r in ref.items():
            assert outs[i].token_ids == r.token_ids, kwargs
            assert outs[i].logprobs == r.logprobs, kwargs


def test_loader_keeps_mtp_aside_and_takes_transformers_names(ckpt, hf):
    cfg, from_ckpt = cpu_engine_model(ckpt)
    assert sorted(from_ckpt.mtp_weights) == sorted(
        f"mtp.0.{k}"
        for k in (
            "attn.wq_a.weight",
            "e_proj.weight",
            "enorm.weight",
            "h_proj.weight",
            "hnorm.weight",
            "norm.weight",
        )
    )
    # transformers' in-memory names (fused experts, self_attn.*, attn_hc.*) load the very same values.
    model = build_model(cfg, make_ops("cpu", True), torch.float32, "cpu")
    model.load_weights(hf.state_dict().items())
    ours = dict(from_ckpt.named_parameters()) | {n: b for n, b in from_ckpt.named_buffers() if "tid2eid" in n}
    theirs = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "tid2eid" in n}
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    good = list(iter_weights(ckpt, "cpu"))
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights([*good, ("model.layers.0.attn.wq_c.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="quantised"):
        model.load_weights([*good, ("model.layers.0.attn.wq_a.scale", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"lacks weights for: .*experts.gate_up_proj\[\(3, 'up'\)\]"):
        model.load_weights([w for w in good if w[0] != "model.layers.2.ffn.experts.3.w3.weight"])


def test_cache_layout_and_capacity_use_per_layer_type_entries(ckpt):
    llm = LLM(model=str(ckpt), device="cpu", dtype="float32", num_kv_blocks=20)
    d, idx = 32, 16
    sliding, hca = d, d + 2 * d + d  # shared kv; + raw kv/gate + compressed entry
    csa = d + 4 * d + d + 4 * idx + idx  # two series, + the indexer's at index_head_dim
    per_token = (sliding + csa + hca + csa) * 4
    # The full layout (every token's rows): kept for configs whose rates are not multiples of the finest.
    full = v4_cache_spec(llm.model_config, 16, torch.float32)
    assert full.bytes_per_token == per_token and not full.bounded
    caches = full.allocate(20, "cpu")
    assert sum(c.numel() * c.element_size() for c in caches) == per_token * 20 * 16
    assert llm.kv_cache_spec.bounded   # what the engine uses, prefix caching on or off


# ---- the bounded layout (prefix caching off): window blocks released, compressed entries kept --------------
BOUNDED = {
    # Chunked prefill and preemption in one setting: the window pool is too small for 8 sequences.
    "chunked_prefill_preemption": dict(num_kv_blocks=9, max_num_seqs=8, max_num_batched_tokens=24),
}


def _record_steps(llm) -> tuple[list[tuple], dict[int, list[int]]]:
    """Wrap the scheduler: (seq_id, start, n, window blocks held) per scheduled sequence and step, and per
    sequence (computed tokens, index into the steps) at each preemption."""
    sched, bm = llm.engine.scheduler, llm.engine.scheduler.block_manager
    steps: list[tuple] = []
    preempted: dict[int, list[tuple[int, int]]] = {}
    schedule, preempt = sched.schedule, bm.preempt

    def recording_schedule():
        out = schedule()
        steps.extend(
            (s.seq.seq_id, s.start, s.num_new_tokens, bm.window_blocks_held(s.seq)) for s in out.scheduled
        )
        return out

    def recording_preempt(seq):
        preempted.setdefault(seq.seq_id, []).append((seq.num_computed_tokens, len(steps)))
        preempt(seq)

    sched.schedule, bm.preempt = recording_schedule, recording_preempt
    return steps, preempted


@pytest.mark.parametrize("setting", list(BOUNDED))
def test_bounded_cache_thirty_mixed_requests_match_hf(setting, ckpt, hf):
    llm = LLM(
        model=str(ckpt),
        device="cpu",
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=256,
        **BOUNDED[setting],
    )
    assert (
        llm.kv_cache_spec.bounded
        and type(llm.engine.scheduler.block_manager).__name__ == "WindowedBlockManager"
    )
    prompts = random_prompts(30, llm.model_config.vocab_size, seed=2, shared_prefix=20)
    steps, preempted = _record_steps(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf.greedy(p)
    if "preemption" in setting:
        assert preempted, "the setting must force preemption"
        restarts = [start for sid, start, n, _ in steps if sid in preempted and n > 1]
        assert any(start > 0 for start in restarts), "some preempted sequence must replay from past 0"


def test_window_blocks_stay_bounded_and_replay_recomputes_the_bounded_span(ckpt, hf):
    """Two long requests generating 4x the window after long prompts, in a cache too small for both: no
    sequence holds more than ceil(window / block_size) + 1 window blocks while decoding, and a preempted one
    recomputes at most the replay span (rounded to a block), not its history."""
    llm = LLM(
        model=str(ckpt),
        device="cpu",
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=256,
        num_kv_blocks=3,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    bm, bs = llm.engine.scheduler.block_manager, llm.cache_cfg.block_size
    prompts = random_prompts(2, llm.model_config.vocab_size, seed=8, lo=60, hi=60)
    params = SamplingParams(temperature=0.0, max_tokens=4 * WINDOW, ignore_eos=True)
    steps, preempted = _record_steps(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4 * WINDOW,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            assert o.token_ids == ref
    bound = -(-WINDOW // bs) + 1
    decode_held = [held for _, _, n, held in steps if n == 1]
    assert decode_held and max(decode_held) <= bound
    assert preempted, "the cache must be too small for both sequences"
    late = [c for events in preempted.values() for c, _ in events if c >= bm.replay_span + bs]
    assert late, "some sequence must be preempted past the replay span, so that the replay is bounded"
    for sid, events in preempted.items():
        for computed, index in events:
            restart = next(start for s, start, _, _ in steps[index:] if s == sid)
            recomputed = computed - restart
            assert 0 <= recomputed <= bm.replay_span + bs - 1, (computed, restart)
            if computed >= bm.replay_span + bs:
                assert restart > 0  # not from the first token
