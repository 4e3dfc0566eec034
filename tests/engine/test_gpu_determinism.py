"""GPU: bitwise-identical tokens and logprobs across batch sizes, chunked prefill and prefix hits (bf16, and
block-scaled FP8: quantization="fp8", the fused group quantization and BlockPlanner's proven M buckets;
per-channel FP8: quantization="fp8-channel", the rowwise GEMM's proven M buckets and its SwiGLU epilogue)."""

from __future__ import annotations

import json
import random

import pytest

from tests.support.cuda_invariance import (
    check_batch_sizes,
    check_chunked_and_prefix_hits,
    cuda_llm,
    run_requests,
)

pytestmark = pytest.mark.gpu

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "eos_token_id": 1,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def llama8b_dir(tmp_path_factory):
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = tmp_path_factory.mktemp("llama8b")
    (d / "config.json").write_text(json.dumps(LLAMA_8B))
    write_tokenizer_files(d)
    return d


def _llm(llama8b_dir, **kw):
    return cuda_llm(llama8b_dir, load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.5, **kw)


def _requests(n: int):
    from deepinfer.engine import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(1000, 120000) for _ in range(96)]
    body = lambda: [rng.randrange(1000, 120000) for _ in range(rng.randint(5, 300))]  # noqa: E731
    prompts = [(prefix if i % 4 == 0 else []) + body() for i in range(n)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i, max_tokens=24, ignore_eos=True,
                             logprobs=1) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8-channel"],
                         ids=["bf16", "fp8-block", "fp8-rowwise"])
def test_bitwise_identity_across_batch_sizes_chunking_and_prefix_hits(llama8b_dir, quantization):
    prompts, params = _requests(256)
    llm = _llm(llama8b_dir, max_num_seqs=256, max_num_batched_tokens=16384, enable_prefix_caching=False,
               quantization=quantization)
    ref = run_requests(llm, prompts, params, list(range(256)))
    check_batch_sizes(llm, prompts, params, ref, (64, 7, 1), start=3)
    if quantization is not None:   # buckets proven on every FP8 weight shape (not one config for all M)
        ops = next(m.ops for m in llm.model.modules() if getattr(m, "ops", None) is not None)
        planner = ops._block_planner if quantization == "fp8" else ops._fp8_planner
        verdicts = planner.verdicts()
        assert len(verdicts) == 4 and all(verdicts.values()), verdicts
    del llm
    chunked = _llm(llama8b_dir, max_num_seqs=64, max_num_batched_tokens=160, enable_prefix_caching=True,
                   quantization=quantization)
    check_chunked_and_prefix_hits(chunked, prompts, params, ref, list(range(0, 256, 9)))
