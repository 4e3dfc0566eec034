"""FP8 checkpoints (block, per-channel, per-tensor) load on CPU and match transformers on the dequantized
weights; quantize-at-load equals offline quantization bitwise (tiny Llama and DeepSeek-V3, float32)."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.models.quant.fp8_format import checkpoint_format, plan_quantization
from deepinfer.engine.models.quant.fp8_tensor import dequantize_fp8, quantize_fp8_block, row_scales

from tests.support.fp8_checkpoints import (
    quantize_tiles,
    write_dequantized_copy,
    write_fp8_copy,
)
from tests.support.tiny_deepseek import make_tiny_deepseek

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint, tmp_path_factory):
    """(arch, scheme) -> (fp8 dir, dequantized dir), built once; arch 'llama' or 'v3' (DeepSeek-V3)."""
    root = tmp_path_factory.mktemp("fp8")
    built: dict = {}

    def get(arch: str, scheme: str = "block", block: tuple[int, int] = (16, 16)):
        key = (arch, scheme, block)
        if key not in built:
            src = tiny_checkpoint("llama") if arch == "llama" else built.get("v3-src")
            if src is None:
                src = built["v3-src"] = make_tiny_deepseek("v3", root / "v3-src")
            name = f"{arch}-{scheme}-{block[0]}"
            fp8 = write_fp8_copy(src, root / name, scheme, block)
            built[key] = (fp8, write_dequantized_copy(fp8, root / f"{name}-deq"))
        return built[key]

    return get


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, **kw)


def _hf_greedy(path, prompts: list[list[int]], deepseek: bool) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if deepseek:
        model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _same_params(a: LLM, b: LLM) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name].view(torch.uint8), sb[name].view(torch.uint8)), name


def test_block_quantizer_is_transformers_writer_and_tiles():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * 0.1
    w[:16, :16] = 0.0  # an all-zero tile keeps scale 1
    q, inv = quantize_fp8_block(w, (16, 16))
    q_ref, inv_ref = quantize_tiles(w, 16, 16)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(inv, inv_ref)
    assert inv.shape == (3, 4) and inv[0, 0] == 1.0
    # Partial edge tiles (DeepSeek's ceil-div grids), e.g. 40 rows in 16-row blocks.
    w2 = torch.randn(40, 72, generator=gen)
    q2, inv2 = quantize_fp8_block(w2, (16, 32))
    q2_ref, inv2_ref = quantize_tiles(w2, 16, 32)
    assert torch.equal(q2.view(torch.uint8), q2_ref.view(torch.uint8)) and torch.equal(inv2, inv2_ref)
    assert (dequantize_fp8(q2, inv2, (16, 32)) - w2).abs().max() <= w2.abs().max() / 16
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
    except ImportError:
        return
    cfg = type("Cfg", (), {"weight_block_size": [16, 16], "scale_fmt": None})()
    hf = Fp8Quantize(type("Q", (), {"quantization_config": cfg})())._quantize_one("x.weight", w)
    assert torch.equal(q.view(torch.uint8), hf["x.weight"].view(torch.uint8))
    assert torch.equal(inv, hf["x.weight_scale_inv"])


def test_row_scales_layout():
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])          # 2 x 2 blocks of 16 x 32 over a [20, 64] weight
    rs = row_scales(scale, 20, 64, 16, (16, 32))             # K-groups of 16: each block column twice
    assert rs.shape == (20, 4)
    assert rs[0].tolist() == [1.0, 1.0, 2.0, 2.0] and rs[19].tolist() == [3.0, 3.0, 4.0, 4.0]
    assert row_scales(torch.tensor([2.0]), 3, 40, 16).tolist() == [[2.0] * 3] * 3
    assert row_scales(torch.tensor([[1.0], [2.0]]), 2, 16, 16).tolist() == [[1.0], [2.0]]
    with pytest.raises(ValueError, match="span two scales"):
        row_scales(scale, 20, 64, 64)


def test_checkpoint_formats_and_plans():
    assert checkpoint_format({}) is None
    fmt = checkpoint_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert fmt.scheme == "block" and fmt.block == (128, 128)
    with pytest.raises(ValueError, match="awq"):
        checkpoint_format({"quantization_config": {"quant_method": "awq"}})
    assert not plan_quantization("auto", fmt, "cpu").fp8_compute
    assert plan_quantization("auto", fmt, "cuda").fp8_compute
    assert plan_quantization("fp8", None, "cpu").quantize_at_load
    assert not plan_quantization(None, fmt, "cuda").fp8_compute
    with pytest.raises(ValueError, match="quantization="):
        plan_quantization("int4", None, "cpu")


@pytest.mark.parametrize("arch", ["llama", "v3"])
def test_block_fp8_greedy_matches_transformers_dequantized(arch, ckpts):
    fp8, deq = ckpts(arch)
    llm = _llm(fp8)
    prompts = _prompts(3, llm.model_config.vocab_size, seed=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == _hf_greedy(deq, prompts, deepseek=arch == "v3")
    _same_params(llm, _llm(deq))  # CPU dequantizes at load: the very weights transformers ran


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_channel_and_tensor_fp8_load_dequantized(scheme, ckpts):
    fp8, deq = ckpts("llama", scheme)
    a, b = _llm(fp8, quantization=None), _llm(deq)
    _same_params(a, b)
    prompt = _prompts(1, a.model_config.vocab_size, seed=5)
    assert a.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == \
        _hf_greedy(deq, prompt, deepseek=False)[0]


@pytest.mark.parametrize("arch", ["llama", "v3"])
def test_quantize_at_load_equals_offline_quantization(arch, ckpts, tiny_checkpoint):
    fp8, _ = ckpts(arch, "block", (128, 128))
    src = tiny_checkpoint("llama") if arch == "llama" else fp8.parent / "v3-src"
    _same_params(_llm(src, quantization="fp8"), _llm(fp8, quantization="auto"))


@pytest.mark.parametrize("arch,scheme", [("llama", "block"), ("llama", "channel"), ("v3", "block")])
def test_fp8_layers_hold_the_checkpoint_weights(arch, scheme, ckpts):
    """The CUDA loading path, run on CPU: FP8 layers (merged qkv / gate_up included, DeepSeek's partial
    edge tiles too) hold e4m3 weights whose row scales give back exactly the dequantized weights, and the
    model runs through `Ops.fp8_linear` (the reference on CPU) close to the dequantized model."""
    from dataclasses import replace

    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import read_checkpoint_format
    from deepinfer.engine.models.quant.fp8_loading import load_with_plan
    from deepinfer.engine.models.registry import build_model

    fp8, deq = ckpts(arch, scheme)
    cfg = ModelConfig.from_dir(fp8)
    plan = replace(plan_quantization("auto", read_checkpoint_format(fp8), "cpu"), fp8_compute=True)
    model = build_model(cfg, make_ops("cpu", True), torch.float32, "cpu")
    load_with_plan(model, iter_weights(fp8, "cpu"), plan)
    dense = _llm(deq).model
    dense_params = dict(dense.named_parameters())
    converted = 0
    for name, module in model.named_modules():
        if getattr(module, "fp8_scale", None) is None:
            continue
        converted += 1
        group = module.fp8_group
        k = module.weight.shape[1]
        full = module.fp8_scale.repeat_interleave(group, 1)[:, :k]
        assert torch.equal(module.weight.float() * full, dense_params[f"{name}.weight"]), name
    assert converted >= 4 * cfg.num_hidden_layers - (2 if arch == "v3" else 0)
    from tests.support.paged_runner import prefill_rel_error

    ids = _prompts(1, cfg.vocab_size, seed=9)[0]
    got, rel = prefill_rel_error(model, dense, cfg, ids)
    # What remains is the activations' e4m3 rounding (per token-group, ~2^-4 relative per layer input);
    # in the MoE model it can flip a token's expert choice, so the median position is what is bounded.
    assert torch.isfinite(got).all() and float(rel.median()) < 0.15


def test_scale_blocks_are_marked_only_where_row_scales_agree_per_128_rows():
    """`mark_scale_blocks` (run after every FP8 load): 128 where each aligned 128-row block of the row scales
    is one value (128 x 128 blocks, a partial last block included), 0 where any block mixes values."""
    from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
    from deepinfer.engine.layers.linear import Linear
    from deepinfer.engine.models.quant.fp8_loading import mark_scale_blocks

    def layer(n: int, block: tuple[int, int]) -> Linear:
        lin = Linear(256, n, False, CpuInvariantOps(), torch.float32)
        q, inv = quantize_fp8_block(torch.randn(n, 256), block)
        lin.weight = torch.nn.Parameter(q, requires_grad=False)
        lin.fp8_scale = torch.nn.Parameter(row_scales(inv, n, 256, 128, block), requires_grad=False)
        lin.fp8_group = 128
        return lin

    dense = Linear(8, 8, False, CpuInvariantOps(), torch.float32)
    model = torch.nn.ModuleDict({"whole": layer(384, (128, 128)), "ragged": layer(300, (128, 128)),
                                 "fine": layer(256, (64, 128)), "dense": dense})
    mark_scale_blocks(model)
    assert model["whole"].fp8_scale_block_n == 128 and model["ragged"].fp8_scale_block_n == 128
    assert model["fine"].fp8_scale_block_n == 0 and not hasattr(model["dense"], "fp8_scale_block_n")
