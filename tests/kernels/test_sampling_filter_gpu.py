"""GPU: the top-k/top-p/min-p sampling kernel against the torch sampler (sort-based), bit for bit — the
fixed-point masses themselves (libdevice's expf vs torch CUDA's exp), the draws of filter mixes at the
Llama-3 shape (256 rows x 128,256; float32 and bf16 logits) and the Qwen2.5 vocabulary (bf16 logits sliced
as the runner slices them, coarse values with ties at every cutoff), fused grammar bitmasks, launch
variants, and batch invariance at 1, 7, 64 and 256 rows."""

from __future__ import annotations

import os
import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.sampler import Sampler, _fixed_point_mass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
V, S = 128256, 256
FILTERS = [SP(temperature=0.9, top_k=50, top_p=0.95), SP(temperature=0.8, top_p=0.9),
           SP(temperature=1.0, top_k=5), SP(temperature=0.7, min_p=0.05),
           SP(temperature=1.3, top_p=0.99, min_p=0.01), SP(temperature=0.6, top_k=2000, top_p=0.5),
           SP(temperature=1.0, top_p=1 - 1e-12)]


@pytest.fixture(scope="module")
def kf():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import sampling_filter

    return sampling_filter


def _logits(s: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(s, v, generator=gen, device=DEV) * 3).to(dtype)


def _meta(params, v: int, seed: int, rows=None) -> SamplingMetadata:
    rng = random.Random(seed)
    seeds = [rng.randrange(2**64) for _ in params]
    positions = [rng.randrange(300) for _ in params]
    rows = range(len(params)) if rows is None else rows
    return SamplingMetadata.from_params([params[i] for i in rows], [seeds[i] for i in rows],
                                        [positions[i] for i in rows], v, DEV)


def _both(logits, meta, bitmask=None, slots=None):
    a = Sampler(use_kernel=True)(logits, meta, bitmask, slots).token_ids
    b = Sampler(use_kernel=False)(logits, meta, bitmask, slots).token_ids
    return a, b


def test_masses_are_torch_cuda_masses_bit_for_bit(kf):
    x = _logits(S, V, 0) / 0.7
    top = x.max(dim=1).values
    assert torch.equal(kf.fixed_point_masses(x, top), _fixed_point_mass(x, top.unsqueeze(1), V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_mixes_equal_the_torch_path_at_128k_vocab_256_rows(dtype):
    rng = random.Random(1)
    params = [rng.choice(FILTERS + [SP(temperature=0.0), SP(temperature=0.9)]) for _ in range(S)]
    a, b = _both(_logits(S, V, 1, dtype), _meta(params, V, 1))
    assert torch.equal(a, b)


def test_qwen_vocab_sliced_bf16_with_ties_at_every_cutoff_equals_the_torch_path():
    v = 151936
    gen = torch.Generator(device=DEV).manual_seed(2)
    wide = (torch.randint(-40, 40, (S, v + 64), generator=gen, device=DEV) / 8).to(torch.bfloat16)
    x = wide[:, :v]                                  # coarse values: ties everywhere; row stride != V
    rng = random.Random(2)
    params = [rng.choice(FILTERS) for _ in range(S)]
    a, b = _both(x, _meta(params, v, 2))
    assert torch.equal(a, b)


def test_fused_bitmask_on_filtered_rows_equals_the_torch_path():
    gen = torch.Generator(device=DEV).manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31, (64, (V + 31) // 32), generator=gen, device=DEV).to(torch.int32)
    rng = random.Random(3)
    slots = torch.tensor([rng.choice([-1] + list(range(64))) for _ in range(S)], device=DEV)
    params = [rng.choice(FILTERS) for _ in range(S)]
    a, b = _both(_logits(S, V, 3), _meta(params, V, 3), bitmask, slots)
    assert torch.equal(a, b)
    allowed = (bitmask[slots.clamp(min=0), a // 32] >> (a % 32)) & 1
    assert bool(allowed[slots >= 0].all())


@pytest.mark.parametrize("launch", [{"sort": 1}, {"sort": 1, "cap": 1}, {"sort": 1, "cap": 256, "hblock": 64},
                                    {"sort": 256, "hblock": 512}, {"sort": 4096, "num_warps": 4}])
def test_launch_variants_change_no_id(kf, launch):
    rng = random.Random(4)
    params = [rng.choice(FILTERS) for _ in range(64)]
    meta = _meta(params, V, 4)
    x = _logits(64, V, 4, torch.bfloat16)
    assert torch.equal(kf.sample_filtered(x, meta.filter_params, **launch),
                       kf.sample_filtered(x, meta.filter_params))


def test_rows_sample_the_same_at_batch_sizes_1_7_64_256():
    rng = random.Random(5)
    params = [rng.choice(FILTERS) for _ in range(S)]
    logits = _logits(S, V, 5, torch.bfloat16)
    sampler = Sampler(use_kernel=True)
    full = sampler(logits, _meta(params, V, 5)).token_ids.tolist()
    for n in (1, 7, 64):
        rows = sorted(rng.sample(range(S), n))
        got = sampler(logits[rows], _meta(params, V, 5, rows)).token_ids.tolist()
        assert got == [full[i] for i in rows], f"batch of {n}"
