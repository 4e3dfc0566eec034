"""On CUDA (Triton kernels): model parity with transformers and bitwise batch invariance in bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.cuda_invariance import CUDA, check_logits_batch_invariant, cuda_model
from tests.support.paged_runner import PagedBatchRunner
from tests.support.tiny_models import TINY_ARCHS

pytestmark = pytest.mark.gpu

# float32: Triton attention and matmuls in IEEE fp32 against cuBLAS/SDPA in HF; bfloat16: a few ulps of
# logits of magnitude ~3 (deepinfer attends in fp32 where transformers rounds to bfloat16 in between).
ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_and_decode_match_hf_on_cuda(arch, deterministic, dtype, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    model, cfg = cuda_model(path, deterministic, dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CUDA).eval()
    prompts = _prompts(cfg.vocab_size, [5, 37, 18], seed=1)
    extra = _prompts(cfg.vocab_size, [4, 4, 4], seed=2)
    runner = PagedBatchRunner(model, cfg)
    for i, p in enumerate(prompts):
        runner.add(f"s{i}", p)
    got = runner.step([(f"s{i}", len(p)) for i, p in enumerate(prompts)])
    outs = {k: [v] for k, v in got.items()}
    for t in range(4):
        for i in range(3):
            runner.append(f"s{i}", extra[i][t])
        for k, v in runner.step([(f"s{i}", 1) for i in range(3)]).items():
            outs[k].append(v)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p + extra[i]], device=CUDA)).logits[0].float()
        diff = (torch.cat(outs[f"s{i}"]) - ref).abs().max().item()
        assert diff <= ATOL[dtype], f"{arch} seq {i}: max |logit diff| {diff}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_deterministic_cuda_logits_are_bitwise_batch_invariant(arch, tiny_checkpoint):
    model, cfg = cuda_model(tiny_checkpoint(arch), True, torch.bfloat16)
    check_logits_batch_invariant(model, cfg, _prompts(cfg.vocab_size, [40, 9, 23, 33, 200, 17], seed=4))
