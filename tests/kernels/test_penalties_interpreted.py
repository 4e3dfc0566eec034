"""The penalty kernel on CPU under Triton's interpreter (started by test_sampling_cpu.py): the plain-torch
reference's bits on every entry, strided rows, empty steps, the sampler's kernel path, and clear errors.
GPU bit-equality (with fused multiply-add off in the compiled kernel) is checked in test_penalties_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.kernels.reference.penalties import apply_penalties_ref

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_sampling_cpu.py")

PARAMS = [SP(temperature=0, repetition_penalty=1.3), SP(temperature=0.8, presence_penalty=0.5, seed=3),
          SP(temperature=0, frequency_penalty=-0.37), SP(temperature=0),
          SP(temperature=1.1, top_k=7, repetition_penalty=0.6, presence_penalty=-1.1, frequency_penalty=0.3),
          SP(temperature=0.7, min_p=0.1, repetition_penalty=2.0, min_tokens=5, seed=1)]


@pytest.fixture(scope="module")
def kp():
    return interpreted_kernels("penalties")


def _batch(n: int, v: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [PARAMS[4]] + [rng.choice(PARAMS) for _ in range(n - 1)]   # row 0 takes every penalty
    prompts = [[rng.randrange(v) for _ in range(rng.randrange(0, 40))] for _ in range(n)]
    outputs = [[rng.randrange(v) for _ in range(rng.randrange(0, 40))] for _ in range(n)]
    logits = torch.randn(n, v, generator=gen) * 6
    logits[torch.rand(n, v, generator=gen) < 0.1] = float("-inf")
    logits[torch.rand(n, v, generator=gen) < 0.1] = 0.0
    meta = SamplingMetadata.from_params(params, list(range(n)), [len(o) for o in outputs], v, "cpu",
                                        prompt_token_ids=prompts, output_token_ids=outputs,
                                        eos_token_ids=[[1]] * n, for_kernel=True)
    return logits, meta


@pytest.mark.parametrize("n,v,seed", [(1, 64, 0), (9, 300, 1), (40, 1500, 2)])
def test_kernel_gives_the_reference_bits(kp, n, v, seed):
    logits, meta = _batch(n, v, seed)
    pen = meta.penalties
    assert pen is not None and pen.entries.shape[1] > kp.BLOCK * (n > 20)   # several programs when large
    want, got = logits.clone(), logits.clone()
    apply_penalties_ref(want, pen.rows, pen.params, pen.entries)
    kp.apply_penalties(got, pen.rows, pen.params, pen.entries)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_strided_rows_and_an_empty_step(kp):
    logits, meta = _batch(6, 100, 3)
    pen = meta.penalties
    wide = torch.zeros(6, 130)
    wide[:, :100] = logits
    got, want = wide[:, :100], logits.clone()
    apply_penalties_ref(want, pen.rows, pen.params, pen.entries)
    kp.apply_penalties(got, pen.rows, pen.params, pen.entries)
    assert torch.equal(got, want) and torch.equal(wide[:, 100:], torch.zeros(6, 30))
    before = logits.clone()
    kp.apply_penalties(logits, pen.rows, pen.params, pen.entries[:, :0])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", range(3))
def test_sampler_kernel_path_equals_torch_path_with_penalties(seed):
    logits, meta = _batch(24, 700, 10 + seed)
    kernel, torch_path = Sampler(use_kernel=True)(logits, meta), Sampler(use_kernel=False)(logits, meta)
    assert kernel.token_ids.tolist() == torch_path.token_ids.tolist()


@pytest.mark.parametrize("change,match", [
    (lambda x, r, p, e: (x.to(torch.float64), r, p, e), "logits: expected float32"),
    (lambda x, r, p, e: (x.t(), r, p, e), "unit stride"),
    (lambda x, r, p, e: (x, r.to(torch.int32), p, e), "rows: expected int64"),
    (lambda x, r, p, e: (x, r, p[:2], e), r"params: expected float32 \[3, "),
    (lambda x, r, p, e: (x, r, p, e.long()), "entries: expected int32"),
    (lambda x, r, p, e: (x, r, p, e[:, :-1]), "entries: must be contiguous"),
    (lambda x, r, p, e: (x, r, torch.stack([p, p], dim=-1)[..., 0], e), "params: must be contiguous"),
])
def test_bad_arguments_are_named(kp, change, match):
    logits, meta = _batch(3, 50, 4)
    pen = meta.penalties
    with pytest.raises(ValueError, match=match):
        kp.apply_penalties(*change(logits, pen.rows, pen.params, pen.entries))
