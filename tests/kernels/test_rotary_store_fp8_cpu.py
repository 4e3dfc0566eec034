"""CPU: the rotary + FP8 (e4m3) KV-store reference, the ops-interface default, the argument checks, and (in a
subprocess with TRITON_INTERPRET=1) the fused kernel's KV_FP8 form itself.

tests/kernels/test_rotary_store_fp8_interpreted.py needs a process started with TRITON_INTERPRET=1;
`test_rotary_store_fp8_kernel_under_interpreter` has tests/support/interpreted.py start one (shared with the
other launchers of the session). `make_fp8_case` is shared with it and with test_rotary_store_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuFastOps, CpuInvariantOps
from deepinfer.kernels.reference.kv_fp8 import FP8_DTYPE, quantize_kv_ref
from deepinfer.kernels.reference.rotary_store import (
    rotary_store_kv_fp8_ref,
    rotary_store_kv_ref,
    rotate_half_ref,
)

from tests.kernels.test_rotary_store_cpu import make_case
from tests.support.interpreted import launches, run_interpreted

# Per-kv-head scales cycled over the heads: tiny ones push |k / s| past 448 (the clamp), large ones into
# e4m3's subnormals, 1.0 is the engine's static default, and 0.3 is not a power of two (a real division).
SCALES = (0.3, 1.0, 0.004, 9.0, 0.0625, 1.7)


def make_fp8_case(num_tokens: int, hq: int, hkv: int, d: int, *, dtype: torch.dtype, block_size: int = 4,
                  seed: int = 0, padded: tuple[int, ...] = (), device: str = "cpu") -> dict:
    """make_case's operands (q/k/v strided views of a merged qkv, large rotary angles, scrambled slots,
    `padded` tokens at -1) with e4m3 caches pre-filled with random values and float32 per-head scales."""
    case = make_case(num_tokens, hq, hkv, d, dtype=dtype, block_size=block_size, seed=seed, padded=padded,
                     device=device)
    gen = torch.Generator().manual_seed(seed + 1000)
    shape = tuple(case["k_cache"].shape)
    for name in ("k_cache", "v_cache"):
        case[name] = (torch.randn(shape, generator=gen) * 64).to(FP8_DTYPE).to(device)
    ks = torch.tensor([SCALES[h % len(SCALES)] for h in range(hkv)], dtype=torch.float32)
    vs = torch.tensor([SCALES[(h + 2) % len(SCALES)] for h in range(hkv)], dtype=torch.float32)
    case.update(k_scale=ks.to(device), v_scale=vs.to(device))
    return case


def fresh_fp8_caches(case: dict) -> dict:
    """The case with its own copy of the caches (each path under test writes into its own)."""
    return {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor's raw bytes: torch.equal on them compares bits (NaN == NaN, -0 != +0)."""
    return t.view(torch.uint8)


def bf16_cache_case(case: dict) -> dict:
    """The same operands with caches in the activation dtype: what the bf16-cache fused path takes."""
    shape, dtype = case["k_cache"].shape, case["q"].dtype
    device = case["q"].device
    extra = ("k_scale", "v_scale")
    return {**{n: t for n, t in case.items() if n not in extra},
            "k_cache": torch.zeros(shape, dtype=dtype, device=device),
            "v_cache": torch.zeros(shape, dtype=dtype, device=device)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_rotates_q_and_stores_quantized_rotated_k_and_v(dtype):
    c = make_fp8_case(10, 4, 3, 16, dtype=dtype, seed=2, padded=(3, 7))
    got = fresh_fp8_caches(c)
    q_rot = rotary_store_kv_fp8_ref(**got)
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    # q: exactly what the activation-dtype reference (the bf16-cache path's definition) returns.
    plain = bf16_cache_case(c)
    assert torch.equal(q_rot, rotary_store_kv_ref(**plain))
    k_q = quantize_kv_ref(rotate_half_ref(c["k"], cos, sin), c["k_scale"])
    v_q = quantize_kv_ref(c["v"], c["v_scale"])
    bs = c["k_cache"].shape[1]
    stored = set()
    for t, slot in enumerate(c["slot_mapping"].tolist()):
        if slot < 0:
            continue
        stored.add(slot)
        assert torch.equal(bits(got["k_cache"][slot // bs, slot % bs]), bits(k_q[t]))
        assert torch.equal(bits(got["v_cache"][slot // bs, slot % bs]), bits(v_q[t]))
        # and the quantization of the rotated k the bf16-cache reference stored
        assert torch.equal(bits(got["k_cache"][slot // bs, slot % bs]),
                           bits(quantize_kv_ref(plain["k_cache"][slot // bs, slot % bs][None],
                                                c["k_scale"])[0]))
    for slot in set(range(c["k_cache"].shape[0] * bs)) - stored:   # padding and unused slots: untouched
        at = (slot // bs, slot % bs)
        assert torch.equal(bits(got["k_cache"][at]), bits(c["k_cache"][at]))
        assert torch.equal(bits(got["v_cache"][at]), bits(c["v_cache"][at]))


def test_case_reaches_the_clamp_and_the_subnormals():
    # The scales are meant to exercise the whole e4m3 range; check they do, so the kernel tests mean it.
    c = make_fp8_case(16, 4, 6, 32, dtype=torch.bfloat16, seed=3)
    got = fresh_fp8_caches(c)
    rotary_store_kv_fp8_ref(**got)
    stored = got["k_cache"].float().abs()
    assert (stored == 448).any() and ((stored > 0) & (stored < 2.0 ** -6)).any()


@pytest.mark.parametrize("ops", [CpuInvariantOps(), CpuFastOps()], ids=lambda o: o.name)
def test_ops_default_is_the_reference(ops):
    c = make_fp8_case(9, 8, 2, 32, dtype=torch.bfloat16, seed=4, padded=(0,))
    a, b = fresh_fp8_caches(c), fresh_fp8_caches(c)
    got = ops.rotary_store_kv_fp8(a["q"], a["k"], a["v"], a["cos"][:, None], a["sin"][:, None],
                                  a["k_cache"], a["v_cache"], a["slot_mapping"], a["k_scale"], a["v_scale"])
    want = rotary_store_kv_fp8_ref(**b)
    assert torch.equal(got, want)
    assert torch.equal(bits(a["k_cache"]), bits(b["k_cache"]))
    assert torch.equal(bits(a["v_cache"]), bits(b["v_cache"]))


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(k_scale=c["k_scale"][:1]), "k_scale: 1 scales for 2 kv heads"),
    (lambda c: c.update(v_scale=c["v_scale"].double()), "v_scale"),
    (lambda c: c.update(k_cache=c["k_cache"].float()), "k_cache"),
    (lambda c: c.update(v=c["v"].to(torch.float16)), "v: dtype"),
    (lambda c: c.update(cos=c["cos"].to(torch.float16)), "cos: dtype"),
    (lambda c: c.update(q=c["q"][:2]), "q: shape"),
    (lambda c: c.update(slot_mapping=c["slot_mapping"][:2]), "slot_mapping"),
])
def test_reference_rejects_bad_operands(change, match):
    c = make_fp8_case(3, 4, 2, 16, dtype=torch.float32)
    change(c)
    with pytest.raises(ValueError, match=match):
        rotary_store_kv_fp8_ref(**c)


@launches("tests/kernels/test_rotary_store_fp8_interpreted.py")
def test_rotary_store_fp8_kernel_under_interpreter(request):
    run_interpreted(request, "rotary + FP8 KV-store kernel")
