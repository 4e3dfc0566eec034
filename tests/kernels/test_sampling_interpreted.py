"""The one-pass sampling kernel on CPU under Triton's interpreter (started by test_sampling_cpu.py).

Checks: the kernel's ids equal the plain-torch reference's and the torch Sampler's (greedy, seeded
temperature sampling, grammar bitmasks, skipped rows, mixed batches with filters/penalties/logprobs), its
noise equals rng.py's, the vocabulary split changes nothing, and a row samples the same alone as in a batch.
The interpreter evaluates log with numpy; GPU bit-equality of libdevice's log with torch CUDA's is checked in
test_sampling_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.rng import gumbel_noise, row_keys
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.masking import apply_token_bitmask_
from deepinfer.kernels.reference.sampling import pack_row_params, sample_tokens_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting
from tests.support.sampler_harness import EOS, _mixed_batch, _take

skip_unless_interpreting("tests/kernels/test_sampling_cpu.py")


@pytest.fixture(scope="module")
def ks():
    return interpreted_kernels("sampling", "_sample_chunk_kernel")


def _logits(s: int, v: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(s, v, generator=gen) * 20) / 10     # coarse: many exact ties
    x[torch.rand(s, v, generator=gen) < 0.1] = float("-inf")
    return x


def _params(s: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    temps = [rng.choice([0.0, 0.0, 0.5, 1.0, 1.7, -1.0]) for _ in range(s)]
    return pack_row_params(temps, [rng.randrange(-2**63, 2**63) for _ in range(s)],
                           [rng.randrange(1000) for _ in range(s)])


def _bitmask(slots: int, v: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (slots, (v + 31) // 32), dtype=torch.int64, generator=gen).to(
        torch.int32)


@pytest.mark.parametrize("v", [37, 1000, 4099])
def test_kernel_matches_reference_greedy_temperature_and_skipped_rows(ks, v):
    x, rp = _logits(12, v, v), _params(12, v)
    assert torch.equal(ks.sample_tokens(x, rp), sample_tokens_ref(x, rp))


def test_kernel_matches_reference_with_bitmask_slots_and_strided_bf16_rows(ks):
    v = 1500
    wide = _logits(9, v + 64, 3)
    x = wide[:, :v]                                   # row stride != V, as the runner's vocab slice
    rp, bm = _params(9, 3), _bitmask(4, v, 3)
    slots = torch.tensor([0, -1, 3, 2, -1, 1, 0, 3, -1], dtype=torch.int32)
    assert torch.equal(ks.sample_tokens(x, rp, bm, slots), sample_tokens_ref(x, rp, bm, slots))
    xb = x.to(torch.bfloat16)
    assert torch.equal(ks.sample_tokens(xb, rp, bm, slots), sample_tokens_ref(xb, rp, bm, slots))


def test_vocab_split_changes_no_result_and_multi_chunk_rows_combine_by_lowest_id(ks, monkeypatch):
    v = 5000
    x, rp = _logits(6, v, 8), _params(6, 8)
    x[0] = -1.0
    x[0, [17, 2100, 4999]] = 3.0                      # greedy ties across chunks: lowest id wins
    x[1] = float("-inf")                              # all -inf: token 0, as torch.argmax
    x[2, 3000] = float("nan")                         # NaN: the first NaN wins, as torch.argmax
    x[2, 4000] = float("nan")
    rp[2, :2] = pack_row_params([0.0, 0.0], [0, 0], [0, 0])[2, :2]
    whole = ks.sample_tokens(x, rp)
    monkeypatch.setattr(ks, "_MAX_SPLIT", 1024)
    assert ks.split_size(v) == 1024
    split = ks.sample_tokens(x, rp)
    assert torch.equal(whole, split) and torch.equal(whole, sample_tokens_ref(x, rp))
    assert whole[0].item() == 17 and whole[1].item() == 0 and whole[2].item() == 3000


def test_ties_in_one_lane_over_iterations_and_launch_variants_keep_the_lowest_id(ks):
    v = 4500
    x, rp = _logits(5, v, 12), _params(5, 12)
    rp[2] = pack_row_params([0.0] * 5, [0] * 5, [0] * 5)[2]     # greedy: the ties decide
    x[0] = -2.0
    x[0, [17 + 3 * 1024, 17 + 1024, 17]] = 5.0                 # one lane, three iterations: 17
    x[1] = -2.0
    x[1, [1041, 2065, 3000]] = 5.0                              # 1041 and 2065 share a lane: 1041
    x[2, 4499] = float("inf")                                   # the last token, the last partial block
    x[3, [4000, 100]] = float("nan")                            # NaN beats +inf; the first NaN wins
    x[3, 50] = float("inf")
    want = sample_tokens_ref(x, rp)
    assert want[:4].tolist() == [17, 1041, 4499, 100]
    for split, warps in [(None, None), (1024, 1), (2048, 2), (3072, 8)]:
        assert torch.equal(ks.sample_tokens(x, rp, split=split, num_warps=warps), want), (split, warps)
    with pytest.raises(ValueError, match="multiple of 1024"):
        ks.sample_tokens(x, rp, split=1000)


def test_kernel_noise_equals_rng_noise(ks):
    rp = _params(5, 11)
    rp[2] = pack_row_params([1.0] * 5, [0] * 5, [0] * 5)[2]   # all rows draw noise
    got = ks.gumbel_noise_triton(rp, 300)
    want = gumbel_noise(row_keys(rp[0], rp[1]), torch.arange(300))
    # numpy's log stands in for libdevice here: allow its last-ulp freedom, the integer stream is exact.
    torch.testing.assert_close(got, want, rtol=4e-16, atol=0)


def _run(logits, params, args, use_kernel, bitmask=None, slots=None):
    meta = SamplingMetadata.from_params(params, seeds=args["seeds"], positions=args["positions"],
                                        vocab_size=logits.shape[1], device="cpu",
                                        prompt_token_ids=args["prompts"], output_token_ids=args["outputs"],
                                        eos_token_ids=args["eos"], for_kernel=True)
    return Sampler(use_kernel=use_kernel)(logits, meta, bitmask, slots)


def test_sampler_kernel_path_equals_torch_path_on_mixed_rows_with_filters_penalties_logprobs(monkeypatch):
    from deepinfer.kernels import sampling_filter

    monkeypatch.setattr(sampling_filter, "_SORT", 256)   # the interpreter's tl.sort is slow
    rows, logits, args = _mixed_batch(1000, 7)
    a, b = _run(logits, rows, args, True), _run(logits, rows, args, False)
    assert torch.equal(a.token_ids, b.token_ids)
    assert [list((d or {}).items()) for d in a.logprobs] == [list((d or {}).items()) for d in b.logprobs]


def _plain_batch(n: int, v: int, seed: int):
    rng = random.Random(seed)
    rows = [rng.choice([SP(temperature=0), SP(temperature=1.0), SP(temperature=0.6),
                        SP(temperature=1.1, repetition_penalty=1.3, min_tokens=3)]) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen) * 2
    args = dict(seeds=[rng.randrange(2**64) for _ in range(n)],
                positions=[rng.randrange(5) for _ in range(n)],
                prompts=[[rng.randrange(v) for _ in range(4)] for _ in range(n)],
                outputs=[[rng.randrange(v) for _ in range(2)] for _ in range(n)], eos=[[EOS]] * n)
    return rows, logits, args


def test_fused_bitmask_equals_caller_masked_torch_path():
    rows, logits, args = _plain_batch(10, 2000, 5)
    bm = _bitmask(3, 2000, 5)
    slots = torch.tensor([0, -1, 2, 1, -1, 0, 2, -1, 1, 0], dtype=torch.int64)
    fused = _run(logits, rows, args, True, bm, slots)
    masked = logits.clone()
    constrained = (slots >= 0).nonzero().flatten()
    apply_token_bitmask_(masked, bm, constrained, slots[constrained])
    assert torch.equal(fused.token_ids, _run(masked, rows, args, False).token_ids)
    assert torch.equal(fused.token_ids, _run(logits, rows, args, False, bm, slots).token_ids)
    tok = fused.token_ids
    assert bool(((bm[slots.clamp(min=0), tok // 32] >> (tok % 32)) & 1)[slots >= 0].all())


def test_kernel_rows_sample_the_same_alone_as_in_a_batch():
    rows, logits, args = _plain_batch(9, 1200, 9)
    batch = _run(logits, rows, args, True).token_ids.tolist()
    for i in (0, 4, 8):
        alone = _run(logits[i : i + 1], [rows[i]], _take(args, [i]), True).token_ids.tolist()
        assert alone == [batch[i]], f"row {i}"
