"""GPU: the one-pass sampling kernel against the torch sampler at the Llama-3 shape (256 rows x 128,256),
bitwise — the noise itself (libdevice log vs torch CUDA log), the sampled ids of temperature, greedy, mixed
(filters, penalties, logprobs), masked and bf16 batches, and batch invariance at 1, 7, 64 and 256 rows; at
the Qwen2.5 vocabulary (151,936, bf16 logits sliced as the runner slices them) greedy ties, NaN and all -inf
rows under every launch variant (split, warps) against the plain-torch reference."""

from __future__ import annotations

import os
import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.rng import gumbel_noise, row_keys
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.reference.sampling import pack_row_params, sample_tokens_ref

from tests.support.sampler_harness import MIXED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
V, S = 128256, 256


@pytest.fixture(scope="module")
def ks():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import sampling

    return sampling


def _logits(s: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(s, V, generator=gen, device=DEV) * 3).to(dtype)


def _meta(params, seed: int, outputs=None) -> SamplingMetadata:
    rng = random.Random(seed)
    n = len(params)
    return SamplingMetadata.from_params(
        params, seeds=[rng.randrange(2**64) for _ in range(n)],
        positions=[rng.randrange(300) for _ in range(n)],
        vocab_size=V, device=DEV, prompt_token_ids=[[rng.randrange(V) for _ in range(20)] for _ in range(n)],
        output_token_ids=outputs or [[rng.randrange(V) for _ in range(8)] for _ in range(n)],
        eos_token_ids=[[2]] * n)


def _both(logits, meta, bitmask=None, slots=None):
    a = Sampler(use_kernel=True)(logits, meta, bitmask, slots)
    b = Sampler(use_kernel=False)(logits, meta, bitmask, slots)
    return a, b


def test_kernel_noise_is_torch_cuda_noise_bit_for_bit(ks):
    rng = random.Random(0)
    rp = pack_row_params([1.0] * S, [rng.randrange(-2**63, 2**63) for _ in range(S)],
                         [rng.randrange(4096) for _ in range(S)]).to(DEV)
    got = ks.gumbel_noise_triton(rp, V)
    want = torch.cat([gumbel_noise(row_keys(rp[0, i:i + 32], rp[1, i:i + 32]), torch.arange(V, device=DEV))
                      for i in range(0, S, 32)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("temps", [(0.8,), (0.0,), (0.0, 1.0, 0.5, 1.7)])
def test_kernel_path_equals_torch_path_at_128k_vocab_256_rows(temps):
    params = [SP(temperature=temps[i % len(temps)]) for i in range(S)]
    meta = _meta(params, 1)
    logits = _logits(S, 1)
    a, b = _both(logits, meta)
    assert torch.equal(a.token_ids, b.token_ids)
    a16, b16 = _both(logits.to(torch.bfloat16), meta)
    assert torch.equal(a16.token_ids, b16.token_ids)


def test_mixed_rows_with_filters_penalties_min_tokens_logprobs_equal_torch_path():
    rng = random.Random(2)
    params = [rng.choice(MIXED + [SP(temperature=0.9)] * 10) for _ in range(S)]
    a, b = _both(_logits(S, 2), _meta(params, 2))
    assert torch.equal(a.token_ids, b.token_ids)
    assert [list((d or {}).items()) for d in a.logprobs] == [list((d or {}).items()) for d in b.logprobs]


def test_fused_bitmask_equals_torch_path_and_allows_only_set_bits():
    gen = torch.Generator(device=DEV).manual_seed(3)
    words = (V + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (64, words), generator=gen, device=DEV).to(torch.int32)
    bitmask[5] = 0
    bitmask[5, 100] = 1 << 7        # slot 5 allows token 3207 only
    rng = random.Random(3)
    slots = torch.tensor([rng.choice([-1, 5] + list(range(64))) for _ in range(S)], device=DEV)
    params = [SP(temperature=rng.choice([0.0, 1.0, 0.6])) for _ in range(S)]
    a, b = _both(_logits(S, 3), _meta(params, 3), bitmask, slots)
    assert torch.equal(a.token_ids, b.token_ids)
    tok = a.token_ids
    allowed = (bitmask[slots.clamp(min=0), tok // 32] >> (tok % 32)) & 1
    assert bool(allowed[slots >= 0].all()) and bool((tok[slots == 5] == 3207).all())


def test_rows_sample_the_same_at_batch_sizes_1_7_64_256():
    rng = random.Random(4)
    params = [SP(temperature=rng.choice([0.0, 1.0, 0.7])) for _ in range(S)]
    seeds = [rng.randrange(2**64) for _ in range(S)]
    positions = [rng.randrange(300) for _ in range(S)]
    logits = _logits(S, 4)
    sampler = Sampler(use_kernel=True)

    def run(rows):
        meta = SamplingMetadata.from_params([params[i] for i in rows], [seeds[i] for i in rows],
                                            [positions[i] for i in rows], V, DEV)
        return sampler(logits[rows], meta).token_ids.tolist()

    full = run(list(range(S)))
    for n in (1, 7, 64):
        rows = sorted(rng.sample(range(S), n))
        assert run(rows) == [full[i] for i in rows], f"batch of {n}"


@pytest.mark.parametrize("launch", [(None, None), (4096, 4), (16384, 8), (1024, 2)])
def test_qwen_vocab_bf16_ties_nan_and_launch_variants_equal_reference(ks, launch):
    v = 151936
    gen = torch.Generator(device=DEV).manual_seed(5)
    wide = (torch.randint(-8, 8, (S, v + 64), generator=gen, device=DEV) / 4).to(torch.bfloat16)
    x = wide[:, :v]                                  # coarse values: many exact ties; row stride != V
    x[0] = -1.0
    x[0, [v - 1, 1041, 17 + 2048, 9000, 17]] = 3.0   # the same lane over iterations, other chunks: 17 wins
    x[1] = float("-inf")                             # token 0
    x[2, [150000, 77]] = float("nan")                # the first NaN: 77
    rng = random.Random(5)
    temps = [0.0, 0.0, 0.0] + [rng.choice([0.0, 0.0, 0.8, -1.0]) for _ in range(S - 3)]
    rp = pack_row_params(temps, [rng.randrange(-2**63, 2**63) for _ in range(S)],
                         [rng.randrange(300) for _ in range(S)]).to(DEV)
    split, warps = launch
    got = ks.sample_tokens(x, rp, split=split, num_warps=warps)
    assert torch.equal(got, sample_tokens_ref(x, rp))
    assert got[:3].tolist() == [17, 0, 77]
