"""CPU: DeepSeek-V4's gathered sink attention reference (kernels/reference/v4_attention.py) against a plain
per-token softmax with the sink as an extra logit, the Lightning Indexer score reference
(kernels/reference/v4_indexer.py) against a per-entry loop, the ops-interface defaults, the argument
checks, and (in the session's TRITON_INTERPRET=1 process, tests/support/interpreted.py) the Triton kernels
themselves.

tests/kernels/test_v4_attention_interpreted.py needs a process started with TRITON_INTERPRET=1 (Triton
decides at import time whether kernels are compiled or interpreted); `test_v4_attention_kernel_under_
interpreter` starts one and fails with its report when an interpreted test fails. The case builders
(`make_case`, `batch_of`, `make_indexer_case`, `indexer_batch_of`) are shared with it and with
tests/kernels/test_v4_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuFastOps, CpuInvariantOps
from deepinfer.kernels.reference.v4_attention import v4_sink_attention_ref
from deepinfer.kernels.reference.v4_indexer import indexer_scores_ref

from tests.support.interpreted import launches, run_interpreted

_NAN_ROWS = 4  # the last rows of each cache hold NaN: only masked slots point there


def make_case(num_tokens: int, heads: int, d: int, window: int, comp: int, *, dtype: torch.dtype,
              seed: int = 0, device: str = "cpu") -> dict:
    """Operands of one call: q [T, H, D]; window rows as a strided column view of wider cache rows (as the
    layer keeps them) and compressed entry rows, each ending in NaN rows; per token `window` window slots
    whose valid ones are a suffix-clipped run (as positions < window give) and `comp` compressed slots with
    a random valid prefix; every invalid slot points at a NaN row. Token 0 has no valid compressed entry."""
    gen = torch.Generator().manual_seed(seed)
    rows_a, rows_b = 3 * window + _NAN_ROWS, 2 * comp + 3 + _NAN_ROWS
    wide = torch.randn(rows_a, d + 24, generator=gen)
    wide[-_NAN_ROWS:] = float("nan")
    entries = torch.randn(rows_b, d, generator=gen)
    entries[-_NAN_ROWS:] = float("nan")
    n_win = torch.randint(1, window + 1, (num_tokens,), generator=gen)
    n_comp = torch.randint(0, comp + 1, (num_tokens,), generator=gen)
    n_comp[0] = 0
    a_valid = torch.arange(window)[None, :] < n_win[:, None]
    b_valid = torch.arange(comp)[None, :] < n_comp[:, None]
    nan_a = torch.randint(rows_a - _NAN_ROWS, rows_a, (num_tokens, window), generator=gen)
    nan_b = torch.randint(rows_b - _NAN_ROWS, rows_b, (num_tokens, comp), generator=gen)
    a_slots = torch.where(a_valid, torch.randint(0, rows_a - _NAN_ROWS, (num_tokens, window), generator=gen),
                          nan_a)
    b_slots = torch.where(b_valid, torch.randint(0, rows_b - _NAN_ROWS, (num_tokens, comp), generator=gen),
                          nan_b)
    q = torch.randn(num_tokens, heads, d, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    wide, entries, q = wide.to(dtype).to(device), entries.to(dtype).to(device), q.to(dtype).to(device)
    return dict(
        q=q,
        sources=[(wide[:, 8:8 + d], a_slots.to(device), a_valid.to(device)),
                 (entries, b_slots.to(device), b_valid.to(device))],
        sinks=sinks.to(device),
        scale=d**-0.5,
    )


def batch_of(case: dict, rows: list[int], pad: int) -> dict:
    """Tokens `rows` of `case` with the compressed lists padded by `pad` more invalid slots (NaN rows): the
    call a token gets inside a batch whose longest list is longer than its own."""
    (ra, sa, va), (rb, sb, vb) = case["sources"]
    sb, vb = sb[rows], vb[rows]
    if pad:
        nan_slot = rb.shape[0] - 1
        sb = torch.cat([sb, torch.full((len(rows), pad), nan_slot, dtype=sb.dtype, device=sb.device)], 1)
        vb = torch.cat([vb, torch.zeros((len(rows), pad), dtype=torch.bool, device=vb.device)], 1)
    return {**case, "q": case["q"][rows], "sources": [(ra, sa[rows], va[rows]), (rb, sb, vb)]}


def _softmax_with_sink(case: dict) -> torch.Tensor:
    """Token by token: softmax over [valid scores..., sink] (the sink's weight multiplies no value)."""
    q, sinks, scale = case["q"].float(), case["sinks"], case["scale"]
    out = torch.zeros(q.shape)
    for t in range(q.shape[0]):
        keys = torch.cat([rows[slots[t][valid[t]]] for rows, slots, valid in case["sources"]]).float()
        logits = torch.cat([q[t] @ keys.T * scale, sinks[:, None]], dim=1)  # [H, L_t + 1]
        out[t] = torch.softmax(logits.double(), dim=1)[:, :-1].float() @ keys
    return out


@pytest.mark.parametrize("invariant", [False, True])
def test_reference_is_a_softmax_with_the_sink_as_an_extra_logit(invariant):
    case = make_case(6, 4, 32, 8, 5, dtype=torch.float32, seed=1)
    got = v4_sink_attention_ref(**case, invariant=invariant)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, _softmax_with_sink(case), atol=1e-5, rtol=1e-5)
    # Token 0 attends to window keys only; a token with no valid key at all gets exact zeros.
    (ra, sa, va), src_b = case["sources"]
    empty = {**case, "sources": [(ra, sa, torch.zeros_like(va)), src_b]}
    assert torch.equal(v4_sink_attention_ref(**empty, invariant=invariant)[0], torch.zeros(4, 32))


def test_invariant_reference_ignores_the_padding_bitwise():
    case = make_case(5, 4, 32, 8, 6, dtype=torch.float32, seed=2)
    whole = v4_sink_attention_ref(**case, invariant=True)
    for t in range(5):
        alone = v4_sink_attention_ref(**batch_of(case, [t], pad=9), invariant=True)
        assert torch.equal(alone[0], whole[t]), t


@pytest.mark.parametrize("ops", [CpuInvariantOps(), CpuFastOps()], ids=lambda o: o.name)
def test_ops_default_is_the_reference_in_q_dtype(ops):
    assert ops.v4_gathers_keys
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(4, 4, 32, 8, 3, dtype=dtype, seed=3)
        got = ops.v4_sink_attention(case["q"], case["sources"], case["sinks"], case["scale"])
        want = v4_sink_attention_ref(**case, invariant=ops.deterministic).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(q=c["q"][0]), "q: expected 3 dimensions"),
    (lambda c: c.update(sinks=c["sinks"][:2]), r"sinks: shape \(2,\)"),
    (lambda c: c.update(sinks=c["sinks"].double()), "sinks: dtype"),
    (lambda c: c.update(sources=[]), "0 key sources"),
    (lambda c: c.update(sources=[(c["sources"][0][0].double(), *c["sources"][0][1:])]), r"rows: dtype"),
    (lambda c: c.update(sources=[(c["sources"][1][0][:, :16], *c["sources"][1][1:])]), "width 16"),
    (lambda c: c.update(sources=[(c["sources"][0][0], c["sources"][0][1].int(), c["sources"][0][2])]),
     r"slots: dtype"),
    (lambda c: c.update(sources=[(c["sources"][0][0], c["sources"][0][1][:2], c["sources"][0][2])]),
     r"sources\[0\]: slots"),
])
def test_reference_rejects_bad_operands(change, match):
    case = make_case(3, 4, 32, 8, 3, dtype=torch.float32)
    change(case)
    with pytest.raises(ValueError, match=match):
        v4_sink_attention_ref(**case)


def make_indexer_case(num_tokens: int, heads: int, dim: int, entries: int, *, dtype: torch.dtype,
                      seed: int = 0, device: str = "cpu") -> dict:
    """Lightning Indexer operands: q [T, H, dim], signed per-head weights [T, H], key rows as a column view
    of wider rows ending in NaN rows, slots [T, C] whose valid prefix (n_valid, token 0: none) points at
    real rows and the rest at NaN rows."""
    gen = torch.Generator().manual_seed(seed)
    n_rows = 2 * entries + _NAN_ROWS
    wide = torch.randn(n_rows, dim + 16, generator=gen)
    wide[-_NAN_ROWS:] = float("nan")
    n_valid = torch.randint(0, entries + 1, (num_tokens,), generator=gen)
    n_valid[0] = 0
    valid = torch.arange(entries)[None, :] < n_valid[:, None]
    slots = torch.where(valid, torch.randint(0, n_rows - _NAN_ROWS, (num_tokens, entries), generator=gen),
                        torch.randint(n_rows - _NAN_ROWS, n_rows, (num_tokens, entries), generator=gen))
    wide = wide.to(dtype).to(device)
    return dict(q=torch.randn(num_tokens, heads, dim, generator=gen).to(dtype).to(device),
                weights=(torch.randn(num_tokens, heads, generator=gen) * heads**-0.5).to(device),
                rows=wide[:, 16:], slots=slots.to(device), valid=valid.to(device), scale=dim**-0.5)


def indexer_batch_of(case: dict, rows: list[int], pad: int) -> dict:
    """Tokens `rows` of an indexer case with `pad` more invalid entries (NaN rows) after their own C."""
    slots, valid = case["slots"][rows], case["valid"][rows]
    extra = (len(rows), pad)
    slots = torch.cat([slots, torch.full(extra, case["rows"].shape[0] - 1, device=slots.device)], 1)
    valid = torch.cat([valid, torch.zeros(extra, dtype=torch.bool, device=valid.device)], 1)
    return {**case, "q": case["q"][rows], "weights": case["weights"][rows], "slots": slots, "valid": valid}


@pytest.mark.parametrize("invariant", [False, True])
def test_indexer_reference_is_the_head_weighted_relu_score(invariant):
    case = make_indexer_case(5, 8, 16, 7, dtype=torch.float32, seed=4)
    got = indexer_scores_ref(**case, invariant=invariant)
    for t in range(5):
        for c in range(7):
            if not case["valid"][t, c]:
                assert got[t, c] == float("-inf")
                continue
            key = case["rows"][case["slots"][t, c]].double()
            dots = case["q"][t].double() @ key
            want = (case["weights"][t].double() * torch.relu(dots) * case["scale"]).sum()
            assert abs(got[t, c].item() - want.item()) < 1e-5, (t, c)


@pytest.mark.parametrize("ops", [CpuInvariantOps(), CpuFastOps()], ids=lambda o: o.name)
def test_ops_indexer_default_is_the_reference(ops):
    case = make_indexer_case(4, 8, 16, 6, dtype=torch.float32, seed=5)
    got = ops.v4_indexer_scores(case["q"], case["weights"], case["rows"], case["slots"], case["valid"],
                                case["scale"])
    assert torch.equal(got, indexer_scores_ref(**case, invariant=ops.deterministic))
    if ops.deterministic:  # and that path ignores padding bitwise
        padded = indexer_scores_ref(**indexer_batch_of(case, [2], 5), invariant=True)
        assert torch.equal(padded[0, :6], got[2]) and (padded[0, 6:] == float("-inf")).all()


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(weights=c["weights"][:, :3]), r"weights: shape"),
    (lambda c: c.update(weights=c["weights"].double()), r"weights: dtype"),
    (lambda c: c.update(rows=c["rows"][:, :8]), "width 8"),
    (lambda c: c.update(slots=c["slots"][:2]), r"slots \(2, 6\)"),
])
def test_indexer_reference_rejects_bad_operands(change, match):
    case = make_indexer_case(3, 8, 16, 6, dtype=torch.float32)
    change(case)
    with pytest.raises(ValueError, match=match):
        indexer_scores_ref(**case)


@launches("tests/kernels/test_v4_attention_interpreted.py")
def test_v4_attention_kernel_under_interpreter(request):
    run_interpreted(request, "V4 sink attention and indexer")
