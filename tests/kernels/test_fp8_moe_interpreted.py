"""The FP8 routed-expert MoE (kernels/fp8_moe.py) under Triton's interpreter (a subprocess with
TRITON_INTERPRET=1, started by tests/kernels/test_fp8_rowwise_cpu.py): the kernel path against
kernels/reference/fp8_moe.py, and a tiny DeepSeek-V3 MoE layer with FP8 experts through the CUDA backend's
`routed_experts_fp8` against the same layer on the CPU backend (the reference)."""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.kernels.reference.fp8_moe import fp8_moe_ref

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in a subprocess with TRITON_INTERPRET=1, started by "
                "tests/kernels/test_fp8_rowwise_cpu.py", allow_module_level=True)

GROUP = 32
HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 4, 2


def _experts(seed: int):
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block, row_scales

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = torch.randn(EXPERTS, n, k, generator=gen) * 0.2
        q, inv = quantize_fp8_block(w, (16, GROUP))
        out += [q, torch.stack([row_scales(inv[e], n, k, GROUP, (16, GROUP)) for e in range(EXPERTS)])]
    return out


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).sort(1).values
    return ids, torch.rand(tokens, TOP_K, generator=gen)


def test_fp8_fused_moe_matches_reference_and_is_row_local():
    pytest.importorskip("triton")
    from deepinfer.kernels.fp8_moe import fp8_fused_moe

    gu, gus, dn, dns = _experts(0)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    ids, weights = _routing(9, seed=2)
    ids[3] = torch.tensor([0, 1])   # several tokens on expert 0, and expert 3 possibly unused
    out = fp8_fused_moe(x, ids, weights, gu, gus, dn, dns, group=GROUP)
    ref = fp8_moe_ref(x, ids, weights, gu, gus, dn, dns, GROUP)
    # The kernel's silu(gate) * up (Triton, float32) and the reference's (torch) can differ by an ulp
    # before the second quantization, which can move an element to the next e4m3 value.
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    alone = fp8_fused_moe(x[3:4].clone(), ids[3:4].clone(), weights[3:4].clone(), gu, gus, dn, dns,
                          group=GROUP)
    assert torch.equal(alone, out[3:4])


@pytest.mark.parametrize("block_m", [16, 32])
def test_grouped_gemm_reading_rows_in_place_gives_the_gathered_bits(block_m):
    """`rows=` (sorted row i reads row rows[i] of the quantized activations) equals gathering the rows
    first, bit for bit, tiles shorter than a segment and padded tail rows included."""
    pytest.importorskip("triton")
    from deepinfer.kernels.fp8_matmul import fp8_grouped_matmul, fp8_tile_config, quantize_act

    gu, gus, _, _ = _experts(3)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    xq, xs = quantize_act(x, GROUP)
    rows = torch.tensor([0, 0, 3, 6, 1, 5, 2, 2, 4, 6, 3, 1, 0, 5, 4, 6, 2, 1, 3], dtype=torch.int64)
    offsets = torch.tensor([0, 2, 2, 19, 19])   # experts 1 and 3 empty, expert 2 longer than 16 rows
    cfg = dict(fp8_tile_config(None, gu.shape[1], HIDDEN, GROUP), BLOCK_M=block_m)
    gathered = fp8_grouped_matmul(xq.view(torch.uint8)[rows].view(xq.dtype), xs[rows], gu, gus, offsets,
                                  torch.float32, group=GROUP, config=cfg)
    in_place = fp8_grouped_matmul(xq, xs, gu, gus, offsets, torch.float32, group=GROUP, config=cfg, rows=rows)
    assert torch.equal(in_place, gathered)
    with pytest.raises(ValueError, match="rows: expected an int64 vector"):
        fp8_grouped_matmul(xq, xs, gu, gus, offsets, torch.float32, group=GROUP, rows=rows.to(torch.int32))


def test_tiny_deepseek_v3_moe_layer_with_fp8_experts_matches_reference():
    pytest.importorskip("triton")
    from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
    from deepinfer.engine.layers.cuda_ops import _CudaOps
    from deepinfer.engine.layers.moe import DeepseekMoE
    from deepinfer.engine.models.deepseek_config import MoEConfig
    from deepinfer.engine.models.quant.fp8_experts import (
        expert_target,
        prepare_fp8_experts,
        write_expert_scales,
    )
    from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_block
    from torch import nn

    class InterpretedOps(CpuInvariantOps):
        routed_experts_fp8 = _CudaOps.routed_experts_fp8   # the CUDA backend's method, Triton interpreted

    cfg = MoEConfig(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
                    moe_intermediate_size=INTER, topk_method="noaux_tc", n_group=2, topk_group=1,
                    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0)
    layer = DeepseekMoE(cfg, HIDDEN, False, CpuInvariantOps(), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    dense = {p: getattr(layer.experts, p).detach().clone() for p in ("gate_up_proj", "down_proj")}
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mlp = layer
    experts = prepare_fp8_experts(root, GROUP)
    assert list(experts) == ["model.layers.0.mlp.experts"]
    for pname, w in dense.items():
        target = expert_target(f"model.layers.0.mlp.experts.{pname}", experts)
        q, inv = quantize_fp8_block(w, (16, GROUP))
        getattr(layer.experts, pname).data.copy_(q)
        write_expert_scales(target, q, inv, (16, GROUP))
    assert layer.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    x = torch.randn(6, HIDDEN, generator=gen)
    with torch.no_grad():
        want = layer(x)                      # CPU backend: Ops.routed_experts_fp8, the reference
        layer.ops = InterpretedOps()
        got = layer(x)                       # the Triton FP8 MoE
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
