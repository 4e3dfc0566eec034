"""The rope epilogue of the batch-invariant 16-bit GEMM (kernels/matmul.bi_linear's `rope`, both loaders) on
CPU under Triton's interpreter (started by test_rope_epilogue_cpu.py), tiny shapes.

The claim the attention layer relies on: on a qkv weight whose rows are in per-head pair order, the fused form
returns the rotated q and writes the caches exactly as the plain GEMM over the original rows followed by the
rotary + KV-store reference does, bit for bit, for every config (pointer and TMA loads, persistent or not,
tiles narrower than a head, ragged shapes, bias, padding slots, the split-K fallbacks).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.rope_layout import RopeStore, interleave_head_halves, qkv_rope_store_ref
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.kernels.test_rotary_store_cpu import make_case
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_rope_epilogue_cpu.py")


@pytest.fixture(scope="module")
def mods():
    return {name: interpreted_kernels(name) for name in ("matmul", "matmul_tma")}


def _operands(m, hq, hkv, d, k, bias, dtype, padded=(), seed=0):
    """x, the qkv weight in its original row order, its bias, and a RopeStore's tensors (make_case's caches
    and slots with gaps, random cos / sin rows)."""
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    case = make_case(m, hq, hkv, d, dtype=dtype, seed=seed + 1, padded=padded)
    # Random cos / sin rows with equal halves, as every rotate_half table has them (RopeStore).
    case["cos"], case["sin"] = (torch.rand(m, d // 2, generator=gen).to(dtype).repeat(1, 2) for _ in range(2))
    return x, w, b, case


def _pair_ordered(out, d):
    """A GEMM output's columns in the pair order `qkv_rope_store_ref` takes (moved, not recomputed)."""
    return interleave_head_halves(out.t(), d).t()


def _rope(case, hq, hkv, d) -> RopeStore:
    return RopeStore(case["cos"], case["sin"], case["k_cache"].clone(), case["v_cache"].clone(),
                     case["slot_mapping"], hq, hkv, d)


def _check(mods, cfg, m, hq, hkv, d, k, bias, dtype, padded=(), launch=None):
    mm = mods["matmul"]
    x, w, b, case = _operands(m, hq, hkv, d, k, bias, dtype, padded, seed=m + d)
    want_rope, got_rope = _rope(case, hq, hkv, d), _rope(case, hq, hkv, d)
    # The GEMM over the original rows, then the reference's rotary + store.
    want = qkv_rope_store_ref(_pair_ordered(mm.bi_linear(x, w, b, config=cfg), d), want_rope,
                              rotary_store_kv_ref)
    wi = interleave_head_halves(w, d)
    bi = interleave_head_halves(b, d) if b is not None else None
    if launch is None:
        got = mm.bi_linear(x, wi, bi, config=cfg, rope=got_rope)
    else:
        got = launch(x, wi, bi, got_rope)
    assert got.shape == (m, hq * d) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want), f"q: {(got != want).sum().item()} elements differ"
    assert torch.equal(got_rope.k_cache, want_rope.k_cache), "k_cache differs"
    assert torch.equal(got_rope.v_cache, want_rope.v_cache), "v_cache differs"


# (m, Hq, Hkv, D, K, bias, block_n, persistent, split_k, serial): the tile 16 rows high throughout.
CASES = [
    (37, 4, 2, 16, 80, False, 16, False, 1, False),   # GQA, ragged M, K tail, tiles as wide as a head
    (21, 3, 1, 32, 64, True, 16, True, 1, False),     # MQA, a tile half a head wide, persistent, bias
    (70, 2, 2, 16, 64, False, 64, True, 1, False),    # tiles over four heads, q / k / v in one tile
    (9, 6, 2, 16, 96, True, 32, False, 3, True),      # the serial split-K: the epilogue after the sum
    (19, 4, 2, 16, 96, True, 32, False, 2, False),    # the parallel split-K: plain GEMM, then the kernel
]
# (m, Hq, Hkv, D, K, bias): a tile of 64 x 256 (a prefill tile's width) over 256 qkv columns.
WIDE = (70, 8, 4, 16, 64, True)


@pytest.mark.parametrize("m,hq,hkv,d,k,bias,bn,persistent,split,serial", CASES)
def test_rope_epilogue_equals_gemm_then_rotary_store(mods, m, hq, hkv, d, k, bias, bn, persistent, split,
                                                     serial):
    cfg = mods["matmul"].MatmulConfig(block_m=16, block_n=bn, block_k=32, group_m=2, num_warps=4,
                                      num_stages=2, persistent=persistent, split_k=split, serial_split=serial)
    _check(mods, cfg, m, hq, hkv, d, k, bias, torch.float16, padded=(0, m - 1))


@pytest.mark.parametrize("warps,chunks", [(4, 4), (2, 0)])
def test_wide_tiles_a_quarter_at_a_time_or_by_the_kernel(mods, monkeypatch, warps, chunks):
    """128 accumulator elements per thread: the epilogue a quarter of the columns at a time; 256: the plain
    GEMM, then the rotary kernel (rope_epilogue_chunks)."""
    from deepinfer.kernels import rope_epilogue

    cfg = mods["matmul"].MatmulConfig(block_m=64, block_n=256, block_k=32, group_m=2, num_warps=warps,
                                      num_stages=2)
    assert rope_epilogue.rope_epilogue_chunks(64, 256, warps, 1, False) == chunks
    ran = []
    monkeypatch.setattr(mods["matmul"], "rope_after", lambda qkv, rope: ran.append(1) or
                        rope_epilogue.rope_after(qkv, rope))
    _check(mods, cfg, *WIDE, torch.float16, padded=(1, 66))
    assert ran == ([] if chunks else [1])


def test_rope_epilogue_in_bfloat16(mods, monkeypatch):
    gpu_like_bf16(monkeypatch)
    cfg = mods["matmul"].MatmulConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4,
                                      num_stages=2)
    _check(mods, cfg, 23, 4, 2, 32, 64, True, torch.bfloat16, padded=(5,))


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_rope_epilogue_equals_the_reference(mods, persistent):
    # Launched directly: on CPU bi_linear never takes TMA loads (tma_usable needs a CUDA device).
    tma = mods["matmul_tma"]
    m, hq, hkv, d = 29, 4, 2, 16
    cfg = mods["matmul"].MatmulConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4,
                                      num_stages=2, persistent=persistent)
    tiles = -(-m // 16) * -(-((hq + 2 * hkv) * d) // 32)
    programs = min(tiles, 3) if persistent else tiles

    def launch(x, w, b, rope):
        out = torch.empty(m, hq * d, dtype=x.dtype)
        return tma.tma_launch(x, w, b, out, 16, 32, 32, 2, 4, 2, programs, rope=rope)

    _check(mods, cfg, m, hq, hkv, d, 64, True, torch.float16, padded=(3,), launch=launch)


def test_rope_epilogue_with_the_planner_and_edge_sizes(mods):
    mm = mods["matmul"]
    m, hq, hkv, d = 33, 4, 2, 16
    x, w, _, case = _operands(m, hq, hkv, d, 64, False, torch.float16)
    planner = mm.MatmulPlanner()
    want_rope, got_rope = _rope(case, hq, hkv, d), _rope(case, hq, hkv, d)
    want = qkv_rope_store_ref(_pair_ordered(mm.bi_linear(x, w, planner=planner), d), want_rope,
                              rotary_store_kv_ref)
    got = mm.bi_linear(x, interleave_head_halves(w, d), planner=planner, rope=got_rope)
    assert torch.equal(got, want) and torch.equal(got_rope.k_cache, want_rope.k_cache)
    assert torch.equal(got_rope.v_cache, want_rope.v_cache)
    # K = 0: the bias alone (or zeros), rotated and stored like any other values.
    zk = mm.bi_linear(torch.empty(m, 0, dtype=torch.float16), torch.empty(w.shape[0], 0, dtype=torch.float16),
                      rope=_rope(case, hq, hkv, d))
    assert torch.equal(zk, torch.zeros(m, hq * d, dtype=torch.float16))
    empty = _operands(0, hq, hkv, d, 64, False, torch.float16)
    none = mm.bi_linear(empty[0], empty[1], rope=_rope(empty[3], hq, hkv, d))
    assert none.shape == (0, hq * d)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_ops_give_the_same_logits_with_the_rope_epilogue(mods, arch, tmp_path, monkeypatch):
    """The CUDA backend on the interpreter, float16: a tiny model (qwen2: a qkv bias) with rotary + KV store
    in its qkv GEMM's epilogue gives the logits of the same model with the rotary kernel, bit for bit,
    through a two-prompt prefill and decode steps; the epilogue really ran in every layer and step."""
    from deepinfer.engine.layers.attention import order_qkv_for_rope
    from deepinfer.engine.layers.cuda_ops import CudaInvariantOps
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model

    from tests.support.paged_runner import two_prompt_logits
    from tests.support.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, tmp_path / arch)
    cfg = ModelConfig.from_dir(path)
    built = []
    for rope_epilogue in (False, True):
        ops = CudaInvariantOps()
        ops.rope_in_16bit_qkv = rope_epilogue
        model = build_model(cfg, ops, torch.float16, "cpu")
        model.load_weights(iter_weights(path, "cpu"))
        assert order_qkv_for_rope(model, torch.float16) == (cfg.num_hidden_layers if rope_epilogue else 0)
        built.append(model)
    fused_calls = []
    bi_linear = mods["matmul"].bi_linear
    monkeypatch.setattr(mods["matmul"], "bi_linear", lambda *a, **kw: (
        fused_calls.append(1) if kw.get("rope") is not None else None) or bi_linear(*a, **kw))
    plain, fused = (two_prompt_logits(m, cfg, 2) for m in built)
    assert len(fused_calls) == 3 * cfg.num_hidden_layers
    for a, b in zip(plain, fused, strict=True):
        assert torch.equal(a, b)
