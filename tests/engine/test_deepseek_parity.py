"""DeepSeek-V2/V3 (MLA + MoE) against transformers on tiny random checkpoints (float32, CPU).

Checkpoints come from tests/support/tiny_deepseek.py: built and saved by transformers' own classes, sharded
with an index, V3 ones with a fake MTP layer the engine must skip.
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.deepseek_config import DeepseekConfig
from deepinfer.engine.models.loader import iter_weights

from tests.support.hf_parity import check_chunked_prefill_and_decode, cpu_engine_model, random_prompts
from tests.support.tiny_deepseek import VARIANTS, tiny_deepseek_builder, write_fused_experts_copy

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_deepseek_builder(tmp_path_factory.mktemp("tiny_deepseek"))


@pytest.fixture(scope="module")
def hf(ckpt):
    """transformers' model of a variant, loaded from the saved checkpoint, and a memoised greedy generate."""
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}
    memo: dict[tuple, list[int]] = {}

    def model(variant: str):
        if variant not in models:
            m = AutoModelForCausalLM.from_pretrained(ckpt(variant), dtype=torch.float32).eval()
            m.set_experts_implementation("eager")  # the plain per-expert loop: the reference, and fast here
            m.generation_config.eos_token_id = None  # we ignore EOS; HF must neither stop nor suppress it
            models[variant] = m
        return models[variant]

    def greedy(variant: str, prompt: list[int]) -> list[int]:
        key = (variant, tuple(prompt))
        if key not in memo:
            with torch.no_grad():
                ids = torch.tensor([prompt])
                out = model(variant).generate(ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    model.greedy = greedy
    return model


def test_config_reads_mla_moe_yarn_and_mtp_fields(ckpt):
    cfg = ModelConfig.from_dir(ckpt("v3"))
    assert isinstance(cfg, DeepseekConfig)
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.cache_dim, mla.rope_interleave) == (24, 32, 40, True)
    assert (cfg.moe.topk_method, cfg.moe.n_group, cfg.moe.first_k_dense_replace) == ("noaux_tc", 4, 1)
    assert cfg.num_mtp_layers == 1 and cfg.yarn is not None and cfg.yarn.mscale_all_dim == 0.8
    mscale = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx(24 ** -0.5 * mscale * mscale)
    v2 = ModelConfig.from_dir(ckpt("v2"))
    assert (v2.moe.topk_method, v2.moe.norm_topk_prob) == ("group_limited_greedy", False)
    assert v2.mla.q_lora_rank is None


def _raw_v3() -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 300,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
            "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "max_position_embeddings": 512}


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4"),
    ({"n_group": 3}, "multiple of n_group=3"),
    ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ({"n_group": 8, "topk_group": 1}, "n_routed_experts / n_group must be >= 2"),
    ({"num_experts_per_tok": 6, "topk_group": 1}, "raise topk_group"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "not supported for DeepSeek"),
    ({"rope_scaling": {"type": "yarn"}}, "lacks or mistypes field"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"}, "DeepSeek-V3 routing"),
])
def test_invalid_configs_say_what_to_change(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**_raw_v3(), **change})


CASES = [(v, True) for v in VARIANTS] + [("v3", False)]


@pytest.mark.parametrize("variant, deterministic", CASES)
def test_prefill_chunks_and_decode_logits_match_hf(variant, deterministic, ckpt, hf):
    """Two sequences, one prefilled in two chunks, then batched decode steps: every row within 1e-4."""
    cfg, model = cpu_engine_model(ckpt(variant), deterministic)
    a, b = random_prompts(2, cfg.vocab_size, seed=3)
    a = (a * 3)[:37]
    check_chunked_prefill_and_decode(model, cfg, hf(variant), a, b, [16, len(a) - 16], steps=6)


def test_fused_expert_checkpoint_loads_the_same_weights(ckpt, tmp_path):
    fused = write_fused_experts_copy(ckpt("v3"), tmp_path / "fused")
    _, per_expert = cpu_engine_model(ckpt("v3"))
    _, fused_model = cpu_engine_model(fused)
    for (name, p), (_, q) in zip(per_expert.named_parameters(), fused_model.named_parameters()):
        assert torch.equal(p, q), name


def test_loader_refuses_what_it_cannot_place(ckpt):
    cfg, model = cpu_engine_model(ckpt("v3"))
    good = list(iter_weights(ckpt("v3"), "cpu"))
    stray = f"model.layers.{cfg.num_hidden_layers + 1}.enorm.weight"   # past the one MTP layer
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights([*good, (stray, torch.zeros(64))])
    with pytest.raises(ValueError, match="block-FP8"):
        model.load_weights([*good, ("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"experts.gate_up_proj\[\(3, 'up'\)\]"):
        model.load_weights([w for w in good if w[0] != "model.layers.1.mlp.experts.3.up_proj.weight"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_request_greedy_matches_hf_generate(variant, ckpt, hf):
    llm = LLM(model=str(ckpt(variant)), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = random_prompts(1, llm.model_config.vocab_size, seed=1)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == hf.greedy(variant, prompt)


SETTINGS = {
    # name: LLM kwargs — each forces a different scheduling path through the same 30 requests.
    "prefix_cache": dict(num_kv_blocks=512),
    "chunked_prefill": dict(num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=8),
    "preemption": dict(num_kv_blocks=24, max_num_seqs=16),
}


MIXED = [("v3", s, 30) for s in SETTINGS] + [("v2", "preemption", 10)]


@pytest.mark.parametrize("variant, setting, count", MIXED)
def test_thirty_mixed_requests_match_hf(variant, setting, count, ckpt, hf):
    llm = LLM(model=str(ckpt(variant)), device="cpu", dtype="float32", **SETTINGS[setting])
    prompts = random_prompts(count, llm.model_config.vocab_size, seed=2, shared_prefix=20)
    if setting == "prefix_cache":  # one earlier request leaves the shared prefix's first block cached
        llm.generate([prompts[0][:17]], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf.greedy(variant, p)
    if setting == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the setting must force preemption"
    if setting == "prefix_cache":
        assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0, "shared prefixes must hit the cache"


def test_moe_model_is_batch_invariant(ckpt):
    """A sampled request alone and inside batches scheduled three ways: bitwise equal tokens and logprobs."""
    path = str(ckpt("v3"))
    rng = random.Random(5)
    alone = LLM(model=path, device="cpu", dtype="float32", num_kv_blocks=128)
    prompts = random_prompts(12, alone.model_config.vocab_size, seed=4, shared_prefix=18)
    params = [SamplingParams(temperature=0.9, top_p=rng.choice([1.0, 0.8]), seed=100 + i, max_tokens=12,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    ref = {i: alone.generate([prompts[i]], params[i], use_tqdm=False)[0] for i in (0, 5, 11)}
    settings = (dict(num_kv_blocks=128), dict(num_kv_blocks=128, max_num_batched_tokens=19, max_num_seqs=5),
                dict(num_kv_blocks=14, max_num_seqs=12))
    for kwargs in settings:
        llm = LLM(model=path, device="cpu", dtype="float32", **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, r in ref.items():
            assert outs[i].token_ids == r.token_ids, kwargs
            assert outs[i].logprobs == r.logprobs, kwargs


def test_latent_cache_holds_rank_plus_rope_values_per_token_and_layer(ckpt):
    from deepinfer.engine.models.deepseek import latent_cache_spec

    llm = LLM(model=str(ckpt("v3")), device="cpu", dtype="float32", num_kv_blocks=20)
    cfg = llm.model_config
    assert llm.kv_cache_spec.bytes_per_token == (32 + 8) * 3 * 4
    caches = llm.engine.runner.kv_caches
    tokens = llm.cache_cfg.num_blocks * llm.cache_cfg.block_size
    per_token = sum(c.numel() * c.element_size() for c in caches) / tokens
    assert per_token == (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_hidden_layers * 4
    # DeepSeek-V3's own shapes: 512 + 64 = 576 values per token and layer, where per-head K and V would be
    # 128 heads * (192 + 128) = 40,960.
    real = DeepseekConfig.from_dict({
        **_raw_v3(), "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8})
    spec = latent_cache_spec(real, 16, torch.bfloat16)
    assert spec.entry_dim == 576 and spec.bytes_per_token == 576 * 61 * 2


# config.json of deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite as published (transformers 4.x layout; fields
# the engine does not read left out).
PUBLISHED = {
    "v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
           "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
           "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
           "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
           "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
           "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1},
    "v2_lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
                "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
                "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False,
                "max_position_embeddings": 163840, "rope_theta": 10000,
                "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                 "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                 "type": "yarn"}},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_parse_and_yarn_matches_transformers(name):
    import transformers as tf
    from deepinfer.engine.layers.mla_rope import yarn_inv_freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = PUBLISHED[name]
    cfg = ModelConfig.from_dict(raw)
    assert isinstance(cfg, DeepseekConfig) and cfg.mla.cache_dim == 576
    hf_cls = tf.DeepseekV3Config if name == "v3" else tf.DeepseekV2Config
    hf_cfg = hf_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert torch.equal(yarn_inv_freq(64, cfg.rope_theta, cfg.yarn), inv_freq)
    assert cfg.yarn.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)
    mscale = 0.1 * raw["rope_scaling"]["mscale_all_dim"] * torch.log(torch.tensor(40.0, dtype=torch.float64))
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * float(mscale + 1) ** 2, rel=1e-9)
