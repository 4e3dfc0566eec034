"""The demo checkpoint and tokenizer files: deterministic, atomic, and loadable by HF transformers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from deepinfer.engine.models.demo import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    SPECIAL_TOKENS,
    demo_model_dir,
    write_tokenizer_files,
)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("vocab_size", [300, 512])
def test_tokenizer_files_are_byte_identical_across_writes(tmp_path: Path, vocab_size: int) -> None:
    n1 = write_tokenizer_files(tmp_path / "a", vocab_size)
    n2 = write_tokenizer_files(tmp_path / "b", vocab_size)
    assert n1 == n2 == vocab_size
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    write_tokenizer_files(tmp_path / "a", vocab_size)  # idempotent overwrite
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_tokenizer_training_is_fast(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    write_tokenizer_files(tmp_path)
    assert time.perf_counter() - t0 < 2.0


def test_tokenizer_config_names_specials_and_chat_template(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN and cfg["pad_token"] == "<|pad|>"
    assert "add_generation_prompt" in cfg["chat_template"]
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert added == {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    assert all(t["special"] for t in tok["added_tokens"])


def test_too_small_vocab_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        write_tokenizer_files(tmp_path, 100)


def test_same_seed_gives_byte_identical_checkpoint_and_other_seed_differs(tmp_path: Path) -> None:
    a = demo_model_dir(tmp_path / "c1", seed=3)
    b = demo_model_dir(tmp_path / "c2", seed=3)
    c = demo_model_dir(tmp_path / "c3", seed=4)
    assert a.name == "demo-llama-v1-3"
    assert _files(a) == _files(b)
    assert _files(a)["model.safetensors"] != _files(c)["model.safetensors"]
    assert _files(a)["tokenizer.json"] == _files(c)["tokenizer.json"]
    # The cache dir holds only the finished model: no temp dirs are left behind.
    assert [p.name for p in (tmp_path / "c1").iterdir()] == ["demo-llama-v1-3"]


def test_existing_dir_is_reused_and_incomplete_dir_is_rebuilt(tmp_path: Path) -> None:
    d = demo_model_dir(tmp_path, seed=0)
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir(tmp_path, seed=0) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    (d / "model.safetensors").unlink()
    assert demo_model_dir(tmp_path, seed=0) == d
    assert (d / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-llama-v1-0"]


def test_concurrent_builders_all_get_the_same_complete_dir(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda _: demo_model_dir(tmp_path, seed=2), range(4)))
    assert len(set(dirs)) == 1
    assert sorted(p.name for p in dirs[0].iterdir()) == ["config.json", "generation_config.json",
                                                         "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["demo-llama-v1-2"]  # losers removed their temp dirs


def test_cache_dir_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "envcache"))
    assert demo_model_dir(seed=1) == tmp_path / "envcache" / "demo-llama-v1-1"


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed_is_refused(tmp_path: Path, seed: object) -> None:
    with pytest.raises(ValueError, match="seed="):
        demo_model_dir(tmp_path, seed=seed)  # type: ignore[arg-type]


def test_checkpoint_loads_in_transformers_llama_with_finite_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = demo_model_dir(tmp_path, seed=0)
    model = transformers.LlamaForCausalLM.from_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == cfg["vocab_size"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = hf_tok("The weather today is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tok.bos_token_id == cfg["bos_token_id"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids(IM_END)]
