"""The sampling kernel's contract on plain CPU torch (no Triton needed): the reference kernel semantics
(kernels/reference/sampling.py) equal the torch Sampler and rng.py; the metadata's kernel fields; the
Sampler's switch and bitmask arguments. The kernel itself runs in test_sampling_interpreted.py (CPU) and
test_sampling_gpu.py (CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.rng import gumbel_noise, random_bits_int, row_keys, to_int64
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.masking import apply_token_bitmask_
from deepinfer.kernels.reference.sampling import (
    FILTER_FIELDS,
    gumbel_ref,
    pack_row_params,
    sample_tokens_ref,
    unpack_temperature,
)


def test_reference_noise_is_rng_noise_bit_for_bit():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567890]
    positions = [0, 1, 7, 1000, 2**31, 3]
    s = torch.tensor([to_int64(x) for x in seeds])
    p = torch.tensor(positions)
    got = gumbel_ref(s, p, 3000)
    assert torch.equal(got, gumbel_noise(row_keys(s, p), torch.arange(3000)))
    # and the integer stream against the pure-Python mixer, through the uniform it feeds
    u = torch.exp(-torch.exp(-got[:, [0, 2999]]))
    for r, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        for c, tok in enumerate((0, 2999)):
            want = ((random_bits_int(seed, pos, tok) >> 12) + 0.5) * 2.0 ** -52
            assert abs(u[r, c].item() - want) < 1e-12


def test_pack_row_params_layout():
    rp = pack_row_params([0.0, 0.7, -1.0], [to_int64(2**64 - 1), 5, 6], [3, 4, 5])
    assert rp.dtype == torch.int64 and rp.shape == (3, 3)
    assert rp[0].tolist() == [-1, 5, 6] and rp[1].tolist() == [3, 4, 5]
    assert unpack_temperature(rp).tolist() == torch.tensor([0.0, 0.7, -1.0]).tolist()


def _rows(n: int, v: int, seed: int):
    rng = random.Random(seed)
    params = [rng.choice([SP(temperature=0), SP(temperature=1.0), SP(temperature=0.37)]) for _ in range(n)]
    seeds = [rng.randrange(2**64) for _ in range(n)]
    positions = [rng.randrange(50) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(n, v, generator=gen) * 20) / 10
    logits[torch.rand(n, v, generator=gen) < 0.1] = float("-inf")
    return params, seeds, positions, logits


@pytest.mark.parametrize("v,seed", [(50, 0), (1000, 1), (4096, 2)])
def test_reference_kernel_equals_torch_sampler_on_greedy_and_temperature_rows(v, seed):
    params, seeds, positions, logits = _rows(16, v, seed)
    meta = SamplingMetadata.from_params(params, seeds, positions, v, "cpu", for_kernel=True)
    assert meta.row_params is not None and meta.filter_params is None
    want = Sampler(use_kernel=False)(logits, meta).token_ids
    assert torch.equal(sample_tokens_ref(logits, meta.row_params), want)


def test_metadata_kernel_fields_skip_filtered_rows_and_describe_them_in_filter_params():
    params = [SP(temperature=0), SP(temperature=0.5), SP(top_k=3), SP(top_p=0.9, temperature=2.0),
              SP(min_p=0.2), SP(temperature=0, top_k=2), SP(top_k=-1)]
    seeds, positions = [1, 2, 3, 4, 5, 6, 2**64 - 1], [0, 1, 2, 3, 4, 5, 6]
    meta = SamplingMetadata.from_params(params, seeds, positions, 100, "cpu", for_kernel=True)
    assert unpack_temperature(meta.row_params).tolist() == [0.0, 0.5, -1.0, -1.0, -1.0, 0.0, 1.0]
    assert meta.row_params[0, -1].item() == -1 and meta.row_params[1].tolist() == positions
    f = meta.filter_params
    assert f is not None and f.shape == (len(FILTER_FIELDS), 3)
    rows, fseeds, fpos, top_k, temp, top_p, min_p = f
    assert rows.tolist() == [2, 3, 4] and fseeds.tolist() == [3, 4, 5] and fpos.tolist() == [2, 3, 4]
    assert top_k.tolist() == [3, 100, 100]
    assert temp.to(torch.int32).view(torch.float32).tolist() == [1.0, 2.0, 1.0]
    assert top_p.view(torch.float64).tolist() == [1.0, 0.9, 1.0]
    assert min_p.to(torch.int32).view(torch.float32).tolist() == pytest.approx([0.0, 0.0, 0.2])
    cpu = SamplingMetadata.from_params(params, seeds, positions, 100, "cpu")
    assert cpu.row_params is None and cpu.filter_params is None   # default: built on CUDA devices only


def test_switch_env_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISABLE_SAMPLING_KERNEL", "1")
    assert Sampler().use_kernel is False
    monkeypatch.setenv("DEEPINFER_DISABLE_SAMPLING_KERNEL", "0")
    assert Sampler().use_kernel is None
    assert Sampler(use_kernel=True).use_kernel is True


def test_sampler_bitmask_arguments_equal_a_caller_applied_mask_on_the_torch_path():
    v = 700
    params = [SP(temperature=0), SP(temperature=1.0, top_p=0.8), SP(temperature=0.8, logprobs=2),
              SP(temperature=1.2)]
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, v, generator=gen)
    bm = torch.randint(-2**31, 2**31, (2, (v + 31) // 32), generator=gen).to(torch.int32)
    slots = torch.tensor([1, 0, -1, 0])
    meta = SamplingMetadata.from_params(params, [9, 8, 7, 6], [0, 1, 2, 3], v, "cpu")
    got = Sampler()(logits, meta, bm, slots)
    masked = logits.clone()
    apply_token_bitmask_(masked, bm, torch.tensor([0, 1, 3]), slots[[0, 1, 3]])
    want = Sampler()(masked, meta)
    assert torch.equal(got.token_ids, want.token_ids) and got.logprobs == want.logprobs
    with pytest.raises(ValueError, match="together"):
        Sampler()(logits, meta, bm, None)
