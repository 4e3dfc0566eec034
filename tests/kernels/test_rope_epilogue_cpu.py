"""CPU: the qkv rope epilogue's row order and operand checks (kernels/reference/rope_layout.py), and (in a
subprocess with TRITON_INTERPRET=1) the GEMM epilogue itself, in
tests/kernels/test_rope_epilogue_interpreted.py."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.rope_layout import RopeStore, head_pairs_to_halves, interleave_head_halves

from tests.kernels.test_rotary_store_cpu import make_case
from tests.support.interpreted import launches, run_interpreted


@launches("tests/kernels/test_rope_epilogue_interpreted.py")
def test_rope_gemm_epilogue_passes_under_interpreter(request):
    run_interpreted(request, "rope GEMM epilogue", allow_skips=False)


@pytest.mark.parametrize("heads,d", [(1, 2), (3, 8), (5, 64)])
def test_pair_order_puts_each_heads_halves_side_by_side(heads, d):
    w = torch.arange(heads * d * 3, dtype=torch.float32).view(heads * d, 3)
    got = interleave_head_halves(w, d)
    half = d // 2
    for h in range(heads):
        rows = got[h * d:(h + 1) * d]
        assert torch.equal(rows[0::2], w[h * d:h * d + half])
        assert torch.equal(rows[1::2], w[h * d + half:(h + 1) * d])
    bias = torch.arange(heads * d, dtype=torch.float32)
    assert torch.equal(interleave_head_halves(bias, d), got[:, 0] / 3)
    # A GEMM output over the reordered rows, put back in order, is the output over the original rows.
    x = torch.randn(4, 3)
    assert torch.equal(head_pairs_to_halves(x @ got.T, d), x @ w.T)


@pytest.mark.parametrize("rows,d", [(12, 3), (10, 4)])
def test_pair_order_needs_whole_heads_of_an_even_size(rows, d):
    with pytest.raises(ValueError, match="whole heads of an even head_dim"):
        interleave_head_halves(torch.zeros(rows, 2), d)


def _store(tokens=5, hq=4, hkv=2, d=16, dtype=torch.bfloat16, **changes) -> RopeStore:
    c = make_case(tokens, hq, hkv, d, dtype=dtype)
    fields = dict(cos=c["cos"], sin=c["sin"], k_cache=c["k_cache"], v_cache=c["v_cache"],
                  slot_mapping=c["slot_mapping"], num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    fields.update(changes)
    return RopeStore(**fields)


def _xw(tokens=5, n=(4 + 4) * 16, dtype=torch.bfloat16):
    return torch.zeros(tokens, 32, dtype=dtype), torch.zeros(n, 32, dtype=dtype)


@pytest.mark.parametrize("store,xw,match", [
    (lambda: _store(), lambda: _xw(n=100), "expected q \\+ k \\+ v"),
    (lambda: _store(dtype=torch.float32), lambda: _xw(dtype=torch.float32), "16-bit activations only"),
    (lambda: _store(cos=torch.zeros(4, 16, dtype=torch.bfloat16)), lambda: _xw(), "cos: shape"),
    (lambda: _store(sin=torch.zeros(5, 16, dtype=torch.float16)), lambda: _xw(), "sin"),
    (lambda: _store(slot_mapping=torch.zeros(4, dtype=torch.int64)), lambda: _xw(), "slot_mapping"),
    (lambda: _store(slot_mapping=torch.zeros(10, dtype=torch.int64)[::2]), lambda: _xw(), "contiguous"),
    (lambda: _store(v_cache=torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16).transpose(1, 2)), lambda: _xw(),
     "v_cache"),
])
def test_rope_store_names_the_operand_that_does_not_fit(store, xw, match):
    x, w = xw()
    with pytest.raises(ValueError, match=match):
        store().check(x, w)


def test_a_fitting_rope_store_passes_its_checks():
    x, w = _xw()
    _store().check(x, w)


# (block_m, block_n, num_warps, split_k, serial, chunks): the H200 tables' decode tiles run it whole, the
# 128 x 256 prefill tiles a quarter of their columns at a time; larger tiles and any parallel split-K not.
CHUNKS = [
    (64, 32, 4, 1, False, 1),      # 0.5B qkv, M <= 128
    (64, 64, 4, 1, False, 1),      # 0.5B qkv, M <= 256; 8B qkv, M <= 64
    (64, 128, 4, 1, False, 1),     # 8B qkv, M <= 128
    (128, 128, 8, 1, False, 1),    # 8B qkv, M <= 256
    (128, 256, 8, 1, False, 4),    # prefill tiles
    (128, 128, 4, 1, False, 4),
    (128, 256, 4, 1, False, 0),    # 256 per thread
    (256, 32, 2, 1, False, 0),     # 128 per thread, quarters of 8 columns: too narrow
    (64, 64, 4, 4, True, 1),       # a serial split sums in the tile's program
    (64, 64, 4, 4, False, 0),      # a parallel one in its reduce
]


@pytest.mark.parametrize("bm,bn,warps,split,serial,chunks", CHUNKS)
def test_how_configs_run_the_rope_epilogue(bm, bn, warps, split, serial, chunks):
    pytest.importorskip("triton")
    from deepinfer.kernels.rope_epilogue import rope_epilogue_chunks

    assert rope_epilogue_chunks(bm, bn, warps, split, serial) == chunks


@pytest.mark.parametrize("scaling", [None, "llama3"])
def test_the_engines_rope_tables_have_equal_halves(scaling):
    """The epilogue reads each cos / sin row's first half for both (RopeStore): every table the engine
    builds must have equal halves."""
    from deepinfer.engine.layers.rotary import RotaryEmbedding
    from deepinfer.engine.models.config import RopeScaling

    scale = None if scaling is None else RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0,
                                                     original_max_position_embeddings=8192)
    rope = RotaryEmbedding(128, 4096, 500000.0, scale)
    for dtype in (torch.bfloat16, torch.float16):
        cos, sin = rope(torch.arange(0, 4096, 7), dtype)
        for t in (cos, sin):
            assert torch.equal(t[..., :64], t[..., 64:])
