"""GPU: the padding rows of a CUDA-graph decode bucket in the routed MoE (DeepSeek-V2-Lite expert shape).

A graph step runs B rows for n real ones; the B - n padding rows (the hidden state of token 0 at position 0:
identical rows) are routed and go through the experts like real tokens, sharing the real tokens' experts
and row blocks. A real token's bits must not move: bf16 experts (`fused_moe`) and FP8 experts
(`fp8_fused_moe`), deterministic mode, eagerly and replayed from one capture with new tokens and routes.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.moe_inputs import expert_weights, routed_tokens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 64, 6, 2048, 1408
REAL, BUCKET = 5, 16


def _fp8_experts():
    gen = torch.Generator(device=CUDA).manual_seed(3)

    def one(n: int, k: int):
        w = (torch.randn(EXPERTS, n, k, device=CUDA, generator=gen) * 100).clamp(-448, 448)
        s = (torch.rand(EXPERTS, n, k // 128, device=CUDA, generator=gen) + 0.1) * 1e-5
        return w.to(torch.float8_e4m3fn), s

    return (*one(2 * INTER, HIDDEN), *one(HIDDEN, INTER))


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def moe(request):
    """(name, f(x, ids, weights) -> [T, H]) with the deterministic (invariant) kernels."""
    if request.param == "bf16":
        from deepinfer.kernels.fused_moe import fused_moe

        gate_up, down = expert_weights(EXPERTS, HIDDEN, INTER, CUDA)
        return request.param, lambda x, ids, w: fused_moe(x, ids, w, gate_up, down, invariant=True)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 experts need compute capability >= 8.9")
    from deepinfer.kernels.fp8_moe import fp8_fused_moe

    gu, gus, dn, dns = _fp8_experts()
    return request.param, lambda x, ids, w: fp8_fused_moe(x, ids, w, gu, gus, dn, dns, invariant=True)


def _bucket(seed: int, padding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REAL real tokens then BUCKET - REAL padding rows: one repeated hidden state, routed to the first real
    token's experts ("crowd": they share its row blocks) or to experts of their own ("spread")."""
    x, ids, w = routed_tokens(BUCKET, seed, HIDDEN, EXPERTS, TOP_K, CUDA)
    x[REAL:] = x[REAL]
    if padding == "crowd":
        ids[REAL:] = ids[0]
    else:
        ids[REAL:] = ids[REAL]
    w[REAL:] = w[REAL]
    return x.contiguous(), ids.contiguous(), w.contiguous()


@pytest.mark.parametrize("padding", ["crowd", "spread"])
def test_padding_rows_leave_the_real_tokens_bits(moe, padding):
    name, f = moe
    for seed in range(3):
        x, ids, w = _bucket(seed, padding)
        alone = f(x[:REAL].contiguous(), ids[:REAL].contiguous(), w[:REAL].contiguous())
        assert torch.equal(f(x, ids, w)[:REAL], alone), f"{name} seed {seed}"


def test_captured_bucket_replays_new_tokens_with_the_eager_bits(moe):
    name, f = moe
    x_buf, ids_buf, w_buf = (t.clone() for t in _bucket(0, "crowd"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f(x_buf, ids_buf, w_buf)      # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(x_buf, ids_buf, w_buf)
    for seed, padding in ((1, "crowd"), (2, "spread"), (3, "crowd")):
        x, ids, w = _bucket(seed, padding)
        for buf, t in ((x_buf, x), (ids_buf, ids), (w_buf, w)):
            buf.copy_(t)
        graph.replay()
        alone = f(x[:REAL].contiguous(), ids[:REAL].contiguous(), w[:REAL].contiguous())
        assert torch.equal(out[:REAL], alone), f"{name} replay seed {seed}"
