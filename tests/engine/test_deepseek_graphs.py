"""CUDA-graph decode steps of DeepSeek-V2/V3 (MLA + routed MoE), the CPU side: which models are captured,
and the graph path with eager stand-in replays (buckets, padding rows, the placeholder host lengths of the
captured metadata, the static output reused every step) giving the eager engine's outputs bit for bit.

The stand-ins run the CPU ops (plain-torch MLA and experts); the Triton kernels' static decode plan is
checked against the host plan in tests/kernels/test_mla_static_decode_interpreted.py, and real graphs on
the GPU in tests/engine/test_deepseek_graphs_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.models.deepseek import DeepseekForCausalLM
from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs, graphs_supported

from tests.support.graph_checks import check_padded_decode_step
from tests.support.tiny_deepseek import tiny_deepseek_builder

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_deepseek_builder(tmp_path_factory.mktemp("tiny_deepseek_graphs"))


class _AddsHostWork(DeepseekForCausalLM):
    """A subclass: it could read device values on the host, so it is never captured."""


@pytest.mark.parametrize("cls,device,captured", [
    (DeepseekForCausalLM, CUDA, True),
    (DeepseekForCausalLM, CPU, False),
    (_AddsHostWork, CUDA, False),
    (DeepseekV4ForCausalLM, CUDA, False),      # window + compressed caches plan on the host: eager
])
def test_graphs_capture_deepseek_v2_v3_exactly(cls, device, captured):
    model = object.__new__(cls)   # the decision reads the class only: no weights needed
    assert graphs_supported(model, device) is captured


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=48, max_num_seqs=12,
               max_num_batched_tokens=64, **kw)


def _requests(vocab: int, n: int = 14) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, vocab, (int(torch.randint(2, 40, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 7, logprobs=1) if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=3 + i % 9, ignore_eos=True,
                             logprobs=2) for i in range(n)]
    return prompts, params


def _view(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


@pytest.mark.parametrize("variant", ["v3", "v2"])   # q LoRA + sigmoid routing; no q LoRA + softmax routing
def test_stand_in_graph_steps_give_the_eager_outputs(variant, ckpt):
    llm = _llm(ckpt(variant))
    prompts, params = _requests(llm.model_config.vocab_size)
    eager = _view(llm.generate(prompts, params, use_tqdm=False))
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 512, 12, CPU)
    graphs.capture_lazily(stand_ins=True)
    llm.engine.executor.graphs = graphs
    for overlap in (True, False):
        llm.engine.async_scheduling = overlap
        assert _view(llm.generate(prompts, params, use_tqdm=False)) == eager, f"overlap={overlap}"
    stats = llm.get_stats()
    assert stats["graph_steps"] > 0 and stats["cuda_graph_padded_rows"] > 0, stats
    assert len(stats["cuda_graph_buckets"]) > 1, stats   # batches shrink as requests finish: several buckets


def test_padding_rows_write_no_latent_and_leave_real_rows_bitwise(ckpt):
    """A decode step of 3 rows run in a bucket of 4: the padding row (token 0 at position 0, slot -1) is
    routed through every MoE layer beside the real rows, yet their hidden states are the eager step's bits,
    and no latent cache entry but the real rows' is written."""
    check_padded_decode_step(_llm(ckpt("v3")), lambda layer: layer.flatten(0, 1))   # latents by slot
