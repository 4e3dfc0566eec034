"""The top-k/top-p/min-p sampling kernel on CPU under Triton's interpreter (started by test_sampling_cpu.py).

Checks: the kernel's draws equal the torch sampler's (sort-based) draws over tables of filters and logits
shapes (exact ties, -inf, +/-0.0, bf16, grammar bitmasks), whatever the buffer size and histogram block
(so both the full-row and the buffered passes are exercised), ties at a cutoff go to the lowest ids, a row
samples the same alone as in a batch, and bad arguments raise errors naming them. The interpreter evaluates
exp with numpy; GPU bit-equality of libdevice's exp with torch CUDA's is checked in
test_sampling_filter_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.sampler import Sampler, _fixed_point_mass
from deepinfer.kernels.reference.sampling import pack_filter_params

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_sampling_cpu.py")


@pytest.fixture(scope="module")
def kf():
    return interpreted_kernels("sampling_filter", "_filter_draw_kernel")


@pytest.fixture(autouse=True)
def _small_sort(kf, monkeypatch):
    # The interpreter runs tl.sort's network in numpy: 256 slots keep a row to ~0.1 s instead of ~3 s.
    monkeypatch.setattr(kf, "_SORT", 256)


def _params(rng: random.Random, v: int, n: int) -> list[SP]:
    out = []
    for _ in range(n):
        kw: dict = {"temperature": rng.choice([0.3, 0.7, 1.0, 1.5, 4.0])}
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([1, 2, 3, 17, 100, v - 1, v + 5])
        if rng.random() < 0.6:
            kw["top_p"] = rng.choice([0.01, 0.3, 0.9, 0.99, 0.999999, 1 - 1e-12])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.01, 0.2, 0.9])
        if len(kw) == 1 or kw.get("top_k", 0) > v - 1 and len(kw) == 2:
            kw["top_p"] = 0.5   # every row narrows, so every row reaches the filter kernel
        out.append(SP(**kw))
    return out


def _logits(kind: str, n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, v, generator=gen) * 3
    if kind == "coarse":        # many exact ties at every cutoff
        x = torch.round(x * 2) / 2
    elif kind == "mostly_-inf":
        x[torch.rand(n, v, generator=gen) < 0.7] = float("-inf")
    elif kind == "flat":        # two values only: every cutoff falls inside a tie
        x = torch.zeros(n, v)
        x[:, ::7] = 1.0
    elif kind == "signed_zeros":   # -0.0 and +0.0 are equal to torch: they must tie in the kernel too
        x = torch.where(torch.rand(n, v, generator=gen) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
        x[:, 5] = 0.5
    elif kind == "narrow":      # values a few ulps apart: the search runs down to single keys
        x = 1.0 + torch.randint(0, 40, (n, v), generator=gen) * 2.0**-23
    return x


def _meta(params: list[SP], v: int, rng: random.Random) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, seeds=[rng.randrange(2**64) for _ in range(n)],
                                        positions=[rng.randrange(300) for _ in range(n)], vocab_size=v,
                                        device="cpu", for_kernel=True)


def _draw(kf, x, meta, bitmask=None, slots=None, **launch):
    return kf.sample_filtered(x, meta.filter_params, bitmask, slots, **launch)


# (logits kind, V, dtype, tokens per chunk, radix buffer, histogram block, sorted path size: 1 = radix only)
CASES = [
    ("plain", 1500, torch.float32, 1024, 64, 32, 1),
    ("plain", 1500, torch.float32, None, 1, None, 1),
    ("plain", 3000, torch.float32, 1024, None, None, 128),
    ("plain", 5000, torch.bfloat16, None, None, None, 1),
    ("plain", 5000, torch.bfloat16, 2048, None, None, 256),
    ("coarse", 1200, torch.float32, None, 64, 32, 1),
    ("coarse", 3000, torch.float32, 1024, None, None, 256),
    ("mostly_-inf", 1500, torch.float32, None, 8, None, 1),
    ("mostly_-inf", 3000, torch.float32, 1024, None, None, 256),
    ("flat", 1500, torch.float32, None, 64, None, 1),
    ("flat", 2000, torch.float32, 1024, None, None, 512),
    ("signed_zeros", 1500, torch.float32, None, 64, None, 1),
    ("signed_zeros", 1500, torch.float32, 1024, None, None, 1024),
    ("narrow", 1200, torch.float16, None, 32, 64, 1),
    ("narrow", 2000, torch.float16, 1024, None, None, 256),
]


@pytest.mark.parametrize(("kind", "v", "dtype", "chunk", "cap", "hblock", "sort"), CASES)
def test_filtered_draws_equal_the_torch_sampler(kf, kind, v, dtype, chunk, cap, hblock, sort):
    rng = random.Random(v + len(kind))
    params = _params(rng, v, 8)
    x = _logits(kind, 8, v, torch.Generator().manual_seed(v)).to(dtype)
    meta = _meta(params, v, rng)
    want = Sampler(use_kernel=False)(x, meta).token_ids.index_select(0, meta.filter_params[0])
    assert torch.equal(_draw(kf, x, meta, chunk=chunk, cap=cap, hblock=hblock, sort=sort), want)


def test_sampler_uses_the_filter_kernel_and_fuses_the_bitmask():
    v, n = 1500, 10
    rng = random.Random(7)
    params = [SP(temperature=1.0, top_p=0.8), SP(temperature=0.0), SP(temperature=0.7, top_k=4),
              SP(temperature=0.9), SP(temperature=1.3, min_p=0.1)] * 2
    x = torch.randn(n, v, generator=torch.Generator().manual_seed(7)) * 2
    words = (v + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (3, words), generator=torch.Generator().manual_seed(8),
                            dtype=torch.int64).to(torch.int32)
    slots = torch.tensor([0, -1, 2, 1, 0, -1, 1, 2, -1, 0])
    meta = _meta(params, v, rng)
    fused = Sampler(use_kernel=True)(x, meta, bitmask, slots).token_ids
    assert torch.equal(fused, Sampler(use_kernel=False)(x, meta, bitmask, slots).token_ids)
    allowed = (bitmask[slots.clamp(min=0), fused // 32] >> (fused % 32)) & 1
    assert bool(allowed[slots >= 0].all())


@pytest.mark.parametrize("sort", [1, 256])
@pytest.mark.parametrize(("filters", "room"), [({"top_k": 3}, 3), ({"top_p": 0.5}, 5), ({"top_k": 7}, 7)])
def test_ties_at_the_cutoff_keep_the_lowest_ids(kf, filters, room, sort):
    v = 1200
    tied = [1199, 700, 7, 1030, 300, 1024, 31, 1100, 900, 999]    # ten tokens at the top value
    x = torch.full((10, v), float("-inf"))
    x[:, tied] = 5.0     # equal masses: top-p 0.5 keeps exactly half of them
    params = [SP(temperature=1.0, **filters)] * 10
    meta = _meta(params, v, random.Random(9))
    got = _draw(kf, x, meta, sort=sort, chunk=1024)
    assert set(got.tolist()) <= set(sorted(tied)[:room])
    assert len(set(got.tolist())) > 1
    assert torch.equal(got, Sampler(use_kernel=False)(x, meta).token_ids)


def test_top_p_near_one_keeps_the_whole_top_k_prefix(kf):
    v = 1500
    x = torch.randn(8, v, generator=torch.Generator().manual_seed(10))
    params = [SP(temperature=1.0, top_k=40, top_p=1 - 1e-15)] * 4 + [SP(temperature=1.0, top_p=1 - 1e-15)] * 4
    meta = _meta(params, v, random.Random(10))
    want = Sampler(use_kernel=False)(x, meta).token_ids
    for sort in (1, 256):
        assert torch.equal(_draw(kf, x, meta, sort=sort), want), sort


def test_a_row_samples_the_same_alone_as_in_a_batch(kf):
    v = 2500
    rng = random.Random(11)
    params = _params(rng, v, 9)
    seeds = [rng.randrange(2**64) for _ in range(9)]
    positions = [rng.randrange(50) for _ in range(9)]
    x = torch.randn(9, v, generator=torch.Generator().manual_seed(11)) * 2

    def run(rows):
        meta = SamplingMetadata.from_params([params[i] for i in rows], [seeds[i] for i in rows],
                                            [positions[i] for i in rows], v, "cpu", for_kernel=True)
        return Sampler(use_kernel=True)(x[rows], meta).token_ids.tolist()

    batch = run(list(range(9)))
    for i in (0, 4, 8):
        assert run([i]) == [batch[i]], f"row {i}"


def test_masses_are_the_torch_paths_fixed_point_masses_up_to_the_exp_ulp(kf):
    # numpy's float32 exp (the interpreter's) and torch's CPU exp differ in the last bit now and then; on
    # the GPU both are libdevice's and the masses are equal bit for bit (test_sampling_filter_gpu.py).
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(12)) * 4
    top = x.max(dim=1).values
    got, want = kf.fixed_point_masses(x, top), _fixed_point_mass(x, top.unsqueeze(1), 3000)
    assert torch.equal(got[x == top.unsqueeze(1)], torch.full((5,), 2**(62 - 12)))   # the top: exactly 2**K
    assert bool(((got - want).abs() <= want.to(torch.float64) * 2.0**-22 + 1).all())   # 1 ulp, truncated


def _params3() -> torch.Tensor:
    return pack_filter_params([0, 1, 2], [1.0] * 3, [0] * 3, [0] * 3, [2] * 3, [1.0] * 3, [0.0] * 3)


BAD_ARGS = [   # (logits, filter_params, message)
    (torch.zeros(3, 100), _params3().to(torch.int32), "filter_params: expected int64 .7, F."),
    (torch.zeros(3, 100), _params3()[:6], "filter_params: expected int64 .7, F."),
    (torch.zeros(3, 100), _params3().t().contiguous().t(), "filter_params: last dimension must be contig"),
    (torch.zeros(3, 100, dtype=torch.int32), _params3(), "logits: expected float32/bf16/fp16"),
    (torch.zeros(3, 200)[:, ::2], _params3(), "logits: last dimension must be contiguous"),
]


@pytest.mark.parametrize(("logits", "params", "message"), BAD_ARGS)
def test_bad_arguments_raise_errors_naming_them(kf, logits, params, message):
    with pytest.raises(ValueError, match=message):
        kf.sample_filtered(logits, params)


@pytest.mark.parametrize(("launch", "message"), [({"hblock": 24}, "hblock=24"), ({"hblock": 8}, "hblock=8"),
                                                 ({"cap": 0}, "cap=0"), ({"sort": 100}, "sort=100"),
                                                 ({"chunk": 1000}, "chunk=1000")])
def test_bad_launch_variants_raise(kf, launch, message):
    with pytest.raises(ValueError, match=message):
        kf.sample_filtered(torch.zeros(3, 100), _params3(), **launch)
