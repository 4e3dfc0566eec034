"""GPU: the compiled penalty kernel gives torch CUDA's bits (IEEE division, no fused multiply-add) at the
Qwen2.5 vocabulary, 256 rows of 512 prompt + 200 output tokens, and the sampler's ids with penalties equal
the torch path's."""

from __future__ import annotations

import os
import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.reference.penalties import apply_penalties_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
V, S = 151936, 256
PARAMS = [SP(temperature=0, repetition_penalty=1.1), SP(temperature=0.8, presence_penalty=0.4, seed=5),
          SP(temperature=0.9, top_k=50, top_p=0.95, frequency_penalty=0.3, presence_penalty=-0.7, seed=6),
          SP(temperature=0.7, repetition_penalty=1.37, presence_penalty=0.11, frequency_penalty=-0.23),
          SP(temperature=0)]


@pytest.fixture(scope="module")
def batch():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    rng = random.Random(0)
    params = [PARAMS[i % len(PARAMS)] for i in range(S)]
    prompts = [[rng.randrange(V) for _ in range(512)] for _ in range(S)]
    # 30% of the outputs repeat a prompt token: ids both seen and counted.
    outputs = [[rng.choice(p) if rng.random() < 0.3 else rng.randrange(V) for _ in range(200)]
               for p in prompts]
    gen = torch.Generator(device=DEV).manual_seed(0)
    logits = (torch.randn(S, V, generator=gen, device=DEV) * 4).to(torch.bfloat16)
    return logits, _meta(params, prompts, outputs), (params, prompts, outputs)


def _meta(params, prompts, outputs, first: int = 0) -> SamplingMetadata:
    """Metadata of batch rows first.. (seed = batch row index)."""
    n = len(params)
    return SamplingMetadata.from_params(params, list(range(first, first + n)), [200] * n, V, DEV,
                                        prompt_token_ids=prompts, output_token_ids=outputs)


def test_kernel_gives_torch_cuda_bits(batch):
    from deepinfer.kernels.penalties import apply_penalties

    _, meta, _ = batch
    pen = meta.penalties
    assert pen.entries.shape[1] > 80_000
    # Random float32 logits: products and sums whose fused and unfused roundings differ somewhere.
    gen = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(S, V, generator=gen, device=DEV) * 9
    want, got = x.clone(), x.clone()
    apply_penalties_ref(want, pen.rows, pen.params, pen.entries)
    apply_penalties(got, pen.rows, pen.params, pen.entries)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got, x)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_sampler_with_penalties_equals_torch_path_and_is_batch_invariant(batch, rows):
    logits, meta, lists = batch
    full = Sampler(use_kernel=True)(logits, meta).token_ids
    assert torch.equal(full, Sampler(use_kernel=False)(logits, meta).token_ids)
    # The last `rows` rows alone: the same ids as inside the full batch.
    sub = _meta(*(x[S - rows:] for x in lists), first=S - rows)
    assert torch.equal(Sampler(use_kernel=True)(logits[S - rows:], sub).token_ids, full[S - rows:])
