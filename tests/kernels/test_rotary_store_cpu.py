"""CPU: the rotary + KV-store reference against transformers' rotary and the unfused store, the ops-interface
default, the argument checks, and (in a subprocess with TRITON_INTERPRET=1) the Triton kernel itself.

tests/kernels/test_rotary_store_interpreted.py needs a process started with TRITON_INTERPRET=1 (Triton decides
at import time whether kernels are compiled or interpreted); `test_rotary_store_kernel_under_interpreter` has
tests/support/interpreted.py start one (shared with the other launchers of the session) and fails when a test
of that file fails. `make_case` is shared with it and with tests/kernels/test_rotary_store_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuFastOps, CpuInvariantOps
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_ref, rotate_half_ref
from deepinfer.kernels.reference.store_kv import store_kv_ref

from tests.support.interpreted import launches, run_interpreted


def make_case(num_tokens: int, hq: int, hkv: int, d: int, *, dtype: torch.dtype, block_size: int = 4,
              seed: int = 0, padded: tuple[int, ...] = (), device: str = "cpu") -> dict:
    """Operands of one step: q/k/v as strided column views of a merged qkv projection (as the attention
    layer has them), cos/sin rows [T, D] of a theta=500000 table at random positions up to 8191 (large
    angles, where rounding differences would show), a cache pre-filled with random values, and slots with
    gaps (a random permutation of the cache's slots) where the tokens in `padded` get -1."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[list(padded)] = -1
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    case = dict(q=q.reshape(num_tokens, hq, d), k=k.reshape(num_tokens, hkv, d),
                v=v.reshape(num_tokens, hkv, d), cos=emb.cos().to(dtype), sin=emb.sin().to(dtype),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    if device != "cpu":
        qkv = qkv.to(device)   # keep the strided-view layout on the device
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        case.update(q=q.reshape(num_tokens, hq, d), k=k.reshape(num_tokens, hkv, d),
                    v=v.reshape(num_tokens, hkv, d),
                    **{n: case[n].to(device) for n in ("cos", "sin", "k_cache", "v_cache", "slot_mapping")})
    return case


def fresh_caches(case: dict) -> dict:
    """The case with its own copy of the caches (each path under test writes into its own)."""
    return {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rotate_half_ref_is_bitwise_transformers_rotary(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    c = make_case(12, 6, 2, 32, dtype=dtype, seed=1)
    # transformers' layout: q/k [B, H, T, D], cos/sin [B, T, D].
    hf_q, hf_k = apply_rotary_pos_emb(c["q"].transpose(0, 1)[None], c["k"].transpose(0, 1)[None],
                                      c["cos"][None], c["sin"][None])
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    assert torch.equal(rotate_half_ref(c["q"], cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(rotate_half_ref(c["k"], cos, sin), hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_rotates_q_and_stores_rotated_k_and_v(dtype):
    c = make_case(10, 4, 2, 16, dtype=dtype, seed=2, padded=(3, 7))
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q_rot = rotary_store_kv_ref(c["q"], c["k"], c["v"], c["cos"], c["sin"], k_cache, v_cache,
                                c["slot_mapping"])
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    assert q_rot.is_contiguous() and torch.equal(q_rot, rotate_half_ref(c["q"], cos, sin))
    k_rot = rotate_half_ref(c["k"], cos, sin)
    bs = k_cache.shape[1]
    stored = set()
    for t, slot in enumerate(c["slot_mapping"].tolist()):
        if slot < 0:
            continue
        stored.add(slot)
        assert torch.equal(k_cache[slot // bs, slot % bs], k_rot[t])
        assert torch.equal(v_cache[slot // bs, slot % bs], c["v"][t])
    for slot in set(range(k_cache.shape[0] * bs)) - stored:   # padding and unused slots: untouched
        assert torch.equal(k_cache[slot // bs, slot % bs], before_k[slot // bs, slot % bs])
        assert torch.equal(v_cache[slot // bs, slot % bs], before_v[slot // bs, slot % bs])


@pytest.mark.parametrize("ops", [CpuInvariantOps(), CpuFastOps()], ids=lambda o: o.name)
def test_ops_default_is_the_reference(ops):
    c = make_case(9, 8, 2, 32, dtype=torch.bfloat16, seed=3, padded=(0,))
    a, b = fresh_caches(c), fresh_caches(c)
    got = ops.rotary_store_kv(a["q"], a["k"], a["v"], a["cos"][:, None], a["sin"][:, None],
                              a["k_cache"], a["v_cache"], a["slot_mapping"])
    want = rotary_store_kv_ref(**b)
    assert torch.equal(got, want)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])


def test_ops_default_casts_into_a_cache_of_another_dtype():
    # The unfused path's store_kv casts k/v to the cache dtype; the op keeps that for the caches the fused
    # kernel does not take.
    c = make_case(5, 2, 1, 16, dtype=torch.float32, seed=4)
    k_cache = c["k_cache"].to(torch.bfloat16)
    v_cache = c["v_cache"].to(torch.bfloat16)
    CpuFastOps().rotary_store_kv(c["q"], c["k"], c["v"], c["cos"][:, None], c["sin"][:, None],
                                 k_cache, v_cache, c["slot_mapping"])
    want_k, want_v = c["k_cache"].to(torch.bfloat16), c["v_cache"].to(torch.bfloat16)
    k_rot = rotate_half_ref(c["k"], c["cos"][:, None], c["sin"][:, None])
    store_kv_ref(k_rot.to(torch.bfloat16), c["v"].to(torch.bfloat16), want_k, want_v, c["slot_mapping"])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(q=torch.zeros(3, 4, 15), k=torch.zeros(3, 2, 15), v=torch.zeros(3, 2, 15),
                        k_cache=torch.zeros(2, 4, 2, 15), v_cache=torch.zeros(2, 4, 2, 15)), "even"),
    (lambda c: c.update(cos=c["cos"][:, None]), "cos: expected 2 dimensions"),
    (lambda c: c.update(sin=c["sin"][:2]), r"sin: shape \(2, 16\)"),
    (lambda c: c.update(cos=c["cos"].to(torch.float16)), "cos: dtype"),
    (lambda c: c.update(q=c["q"][:2]), "q: shape"),
    (lambda c: c.update(q=c["q"].to(torch.float16)), "q: dtype"),
    (lambda c: c.update(slot_mapping=c["slot_mapping"][:2]), "slot_mapping"),
])
def test_reference_rejects_bad_operands(change, match):
    c = make_case(3, 4, 2, 16, dtype=torch.float32)
    change(c)
    with pytest.raises(ValueError, match=match):
        rotary_store_kv_ref(**c)


@launches("tests/kernels/test_rotary_store_interpreted.py")
def test_rotary_store_kernel_under_interpreter(request):
    run_interpreted(request, "rotary + KV-store kernel")
