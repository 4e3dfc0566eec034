"""Model directory resolution, weight streaming, config parsing and weight mapping: behaviour and errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.models.config import ModelConfig, RopeScaling
from deepinfer.engine.models.loader import iter_weights, resolve_dtype, resolve_model_dir
from deepinfer.engine.models.registry import build_model, supported_architectures
from safetensors.torch import load_file, save_file

# ---------------------------------------------------------------- resolve_model_dir


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf_cache"))
    return monkeypatch


def _fake_hf_cache(root: Path, repo_id: str) -> Path:
    """The hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_local_directory_wins(clean_env, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    clean_env.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    assert resolve_model_dir(str(d)) == d


def test_env_model_dir_is_used_for_names(clean_env, tmp_path, monkeypatch):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    clean_env.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path / "org")  # "org/tiny" must not resolve relative to the working directory
    assert resolve_model_dir("org/tiny") == tmp_path / "org" / "tiny"


def test_hf_cache_snapshot_is_found_without_network(clean_env, tmp_path):
    snap = _fake_hf_cache(tmp_path / "hub", "someorg/somemodel")
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    clean_env.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert resolve_model_dir("someorg/somemodel").resolve() == snap.resolve()


def test_hf_home_locates_the_cache(clean_env, tmp_path):
    snap = _fake_hf_cache(tmp_path / "home" / "hub", "a/b")
    clean_env.delenv("HF_HUB_CACHE")
    clean_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_dir("a/b").resolve() == snap.resolve()


def test_missing_model_names_every_place_tried(clean_env, tmp_path):
    clean_env.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    with pytest.raises(ValueError) as err:
        resolve_model_dir("nobody/nothing")
    msg = str(err.value)
    assert "nobody/nothing" in msg and "local directory" in msg
    assert "DEEPINFER_HF_MODEL_DIR" in msg and "Hugging Face cache" in msg


def test_demo_name_builds_the_demo_model(clean_env, tmp_path):
    clean_env.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    d = resolve_model_dir("demo")
    assert (d / "config.json").is_file() and d.is_relative_to(tmp_path / "cache")
    assert ModelConfig.from_dir(d).architecture == "LlamaForCausalLM"


# ---------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def qwen2_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


def _all(model_dir: Path, **kw) -> dict[str, torch.Tensor]:
    return dict(iter_weights(model_dir, torch.device("cpu"), **kw))


def _copy_config(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)


def test_sharded_safetensors_with_index_load_every_tensor(qwen2_dir, tmp_path):
    state = load_file(str(qwen2_dir / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    _copy_config(qwen2_dir, tmp_path)
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = _all(tmp_path)
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[k], state[k]) for k in names)
    cfg = ModelConfig.from_dir(tmp_path)
    model = build_model(cfg, make_ops("cpu"), torch.float32, "cpu")
    model.load_weights(iter_weights(tmp_path, "cpu"))  # complete: no missing-weight error


def test_index_naming_a_missing_shard_is_an_error(qwen2_dir, tmp_path):
    _copy_config(qwen2_dir, tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing"):
        iter_weights(tmp_path, "cpu")


def test_pickle_checkpoint_is_refused_unless_allowed(qwen2_dir, tmp_path):
    state = load_file(str(qwen2_dir / "model.safetensors"))
    _copy_config(qwen2_dir, tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        iter_weights(tmp_path, "cpu")
    loaded = _all(tmp_path, allow_pickle=True)
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], state[k]) for k in state)


def test_directory_without_weights_is_an_error(qwen2_dir, tmp_path):
    _copy_config(qwen2_dir, tmp_path)
    with pytest.raises(ValueError, match="no weight files"):
        iter_weights(tmp_path, "cpu")


def _model(model_dir: Path):
    cfg = ModelConfig.from_dir(model_dir)
    return build_model(cfg, make_ops("cpu"), torch.float32, "cpu")


def test_load_weights_rejects_unknown_misshapen_and_missing_tensors(qwen2_dir):
    state = load_file(str(qwen2_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="no matching parameter"):
        _model(qwen2_dir).load_weights([*state.items(), ("model.extra.weight", torch.zeros(1))])
    bad = dict(state, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        _model(qwen2_dir).load_weights(bad.items())
    partial = {k: v for k, v in state.items() if ".k_proj." not in k}
    with pytest.raises(ValueError, match=r"qkv_proj\.weight\[k\]"):
        _model(qwen2_dir).load_weights(partial.items())


def test_load_weights_merges_qkv_and_gate_up_in_order_and_ignores_tied_head(qwen2_dir):
    state = load_file(str(qwen2_dir / "model.safetensors"))
    model = _model(qwen2_dir)
    extra = [("lm_head.weight", torch.zeros(1)), ("model.rotary_emb.inv_freq", torch.zeros(1))]
    model.load_weights([*state.items(), *extra])
    p = "model.layers.1."
    qkv = model.model.layers[1].self_attn.qkv_proj
    expected = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv.weight, expected)
    assert torch.equal(qkv.bias, torch.cat([state[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    expected = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
    assert torch.equal(gate_up, expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_weights_are_seeded_and_need_no_weight_files(qwen2_dir, tmp_path):
    _copy_config(qwen2_dir, tmp_path)
    a, b, c = _model(tmp_path), _model(tmp_path), _model(tmp_path)
    a.init_dummy_weights(3)
    b.init_dummy_weights(3)
    c.init_dummy_weights(4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    assert torch.equal(pa["model.norm.weight"], torch.ones_like(pa["model.norm.weight"]))
    assert all(torch.isfinite(v).all() for v in pa.values())


# ---------------------------------------------------------------- config.json and dtype


def _write_config(d: Path, cfg: dict, gen: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


BASE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5,
)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.mark.parametrize("extra", [
    # transformers 4.x layout
    dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **LLAMA3), torch_dtype="bfloat16"),
    dict(rope_theta=500000.0, rope_scaling=dict(type="llama3", **LLAMA3), torch_dtype="bfloat16"),
    # transformers 5.x layout (5.17 and 5.24 both write rope_parameters and dtype)
    dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3), dtype="bfloat16"),
    dict(rope_parameters={"full_attention": dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3)},
         dtype="bfloat16"),
], ids=["4x-rope_type", "4x-type", "5x", "5x-per-layer-type"])
def test_both_config_layouts_parse_to_the_same_config(tmp_path, extra):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, dict(BASE, **extra)))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", **LLAMA3)
    assert cfg.head_dim == 16 and cfg.torch_dtype == "bfloat16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16


def test_rope_theta_defaults_and_qwen2_always_has_qkv_bias(tmp_path):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, dict(BASE, architectures=["Qwen2ForCausalLM"])))
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert resolve_dtype("auto", cfg) == torch.float32  # no dtype recorded


def test_eos_ids_merge_generation_config_then_config(tmp_path):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, dict(BASE, eos_token_id=7, bos_token_id=1),
                                             gen=dict(eos_token_id=[9, 7])))
    assert cfg.eos_token_ids == (9, 7) and cfg.bos_token_id == 1


@pytest.mark.parametrize("dtype,expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16), (torch.float16, torch.float16)])
def test_explicit_dtype(tmp_path, dtype, expected):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, dict(BASE, dtype="bfloat16")))
    assert resolve_dtype(dtype, cfg) == expected


@pytest.mark.parametrize("dtype", ["int8", "fp8", "", torch.int32])
def test_invalid_dtype_is_a_value_error(tmp_path, dtype):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, BASE))
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(dtype, cfg)


@pytest.mark.parametrize("change,match", [
    (dict(architectures=None), "architectures"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_hidden_layers="2"), "num_hidden_layers"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "yarn"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_invalid_config_field_is_named(tmp_path, change, match):
    raw = {k: v for k, v in dict(BASE, **change).items() if v is not None}
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_dir(_write_config(tmp_path, raw))
    assert "config.json" in str(err.value)


def test_missing_or_broken_config_json_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, dict(BASE, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        build_model(cfg, make_ops("cpu"), torch.float32, "cpu")
    assert all(a in str(err.value) for a in supported_architectures())
    assert set(supported_architectures()) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                              "Qwen3ForCausalLM", "DeepseekV2ForCausalLM",
                                              "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM"}


def test_max_model_len_bounds_the_rotary_table(tmp_path):
    cfg = ModelConfig.from_dir(_write_config(tmp_path, BASE))
    assert build_model(cfg, make_ops("cpu"), torch.float32, "cpu").max_positions == 256
    assert build_model(cfg, make_ops("cpu"), torch.float32, "cpu", max_model_len=64).max_positions == 64
