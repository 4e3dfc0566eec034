"""Bad input to the engine raises a ValueError that names the problem; the engine stays usable."""

from __future__ import annotations

import json
import shutil

import pytest
from deepinfer.engine import LLM, SamplingParams


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"), device="cpu")


def test_unsupported_architecture(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(bad), device="cpu")


def test_missing_tokenizer(model_dir, tmp_path):
    bad = tmp_path / "notok"
    shutil.copytree(model_dir, bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=str(bad), device="cpu")


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e39), "temperature"),     # inf in float32
    (dict(temperature="0.7"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),   # 0 and -1 both mean disabled (DESIGN.md, second-round contracts)
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-2), "logprobs"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty="1.1"), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(regex="a", choice=["b"]), "at most one"),
])
def test_sampling_params_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len_leaves_engine_usable(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=64)
    good = [5, 6, 7]
    with pytest.raises(ValueError, match="prompt 1 has 80 tokens"):
        llm.generate([good, list(range(10, 90))], SamplingParams(max_tokens=4), use_tqdm=False)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([good], greedy, use_tqdm=False)
    assert len(outs[0].token_ids) == 4


def test_out_of_vocabulary_token(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**9]], use_tqdm=False)
