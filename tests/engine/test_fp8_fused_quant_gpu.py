"""Fused FP8 activation quantization in the engine on a real GPU (`-m gpu`, sm89+): quantization="fp8-channel"
models whose norms / SiLU-and-mul hand the rowwise linears quantized rows (kernels/fp8_fused_quant.py), and
quantization="fp8" (block-scaled) models whose producers quantize per token and 128-group
(kernels/fp8_group_quant.py), give bit for bit the logits and greedy tokens of the same models quantizing
inside the linears (DEEPINFER_DISABLE_FUSED_FP8_QUANT=1 / `fuses_fp8_row_quant` off)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_ok(), reason="needs an FP8 GPU (compute capability >= 8.9)")

# Llama-3.1-8B's layer widths (hidden 4096, intermediate 14,336: the fused kernels' real shapes), 2 layers.
WIDE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "rope_theta": 500000.0}


def _cuda_model(path, fused: bool, dummy: bool, quantization: str = "fp8-channel"):
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import plan_quantization
    from deepinfer.engine.models.quant.fp8_loading import init_dummy_with_plan, load_with_plan
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    ops = make_ops(CUDA, True)
    ops.fuses_fp8_row_quant = fused
    plan = plan_quantization(quantization, None, CUDA)
    model = build_model(cfg, ops, torch.bfloat16, torch.device(CUDA))
    with torch.no_grad():
        if dummy:
            init_dummy_with_plan(model, plan, seed=0)
            gen = torch.Generator(device=CUDA).manual_seed(1)
            for name, p in model.named_parameters():     # norm weights away from 1: the scale matters
                if name.endswith("layernorm.weight"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, device=CUDA, generator=gen))
        else:
            load_with_plan(model, iter_weights(path, CUDA), plan)
    return model, cfg


def _logits(model, cfg) -> list[torch.Tensor]:
    from tests.support.paged_runner import PagedBatchRunner

    runner = PagedBatchRunner(model, cfg)
    gen = torch.Generator().manual_seed(0)
    for key, n in (("a", 37), ("b", 5), ("c", 130)):
        runner.add(key, torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist())
    out = runner.step([("a", 37), ("b", 5), ("c", 130)])
    steps = [out[k] for k in "abc"]
    for _ in range(3):
        for key in "abc":
            runner.append(key, int(out[key][-1].argmax()))
        out = runner.step([(k, 1) for k in "abc"])
        steps += [out[k] for k in "abc"]
    return steps


@needs_fp8
@pytest.mark.parametrize("shape", ["tiny", "llama-8b-widths"])
@pytest.mark.parametrize("quantization", ["fp8-channel", "fp8"])
def test_fused_path_same_logits_as_unfused(shape, quantization, tiny_checkpoint, tmp_path):
    if shape == "tiny":
        path, dummy = tiny_checkpoint("llama", dtype=torch.bfloat16), False
    else:
        path, dummy = tmp_path / "wide", True
        path.mkdir()
        (path / "config.json").write_text(json.dumps(WIDE))
    runs = {}
    for fused in (True, False):
        model, cfg = _cuda_model(path, fused, dummy, quantization)
        projs = [m for n, m in model.named_modules() if n.endswith(("qkv_proj", "gate_up_proj", "down_proj"))]
        assert projs and all(m.takes_quantized_rows == fused for m in projs)
        if quantization == "fp8" and shape != "tiny":      # 128-groups, one weight scale per 128-row block
            assert all(m.quant_group == 128 and m.fp8_scale_block_n == 128 for m in projs)
        runs[fused] = _logits(model, cfg)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    for a, b in zip(runs[True], runs[False]):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@needs_fp8
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("quantization", ["fp8-channel", "fp8"])
def test_llm_fused_path_same_greedy_tokens_with_graphs(tmp_path, monkeypatch, deterministic, quantization):
    """Through LLM (CUDA graphs, overlap): the fused and unfused engines give the same greedy tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.layers.cuda_ops import DISABLE_FUSED_FP8_QUANT_ENV

    from benchmarks.shapes import write_shape

    d = write_shape("qwen2.5-0.5b", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 150000, (int(n),), generator=gen).tolist() for n in (5, 70, 300, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for fused in (True, False):
        if fused:
            monkeypatch.delenv(DISABLE_FUSED_FP8_QUANT_ENV, raising=False)
        else:
            monkeypatch.setenv(DISABLE_FUSED_FP8_QUANT_ENV, "1")
        llm = LLM(model=str(d), load_format="dummy", quantization=quantization, deterministic=deterministic,
                  max_model_len=1024, gpu_memory_utilization=0.3)
        downs = [m for n, m in llm.model.named_modules() if n.endswith("down_proj")]
        assert downs and all(m.takes_quantized_rows == fused for m in downs)
        tokens[fused] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


# bf16: only the deterministic backend has the 16-bit SWIGLU epilogue (the fast one runs cuBLAS).
@pytest.mark.parametrize("quantization,deterministic", [("fp8-channel", True), ("fp8-channel", False),
                                                         (None, True)])
def test_llm_swiglu_in_gate_up_same_tokens_and_logprobs(tmp_path, monkeypatch, quantization, deterministic):
    """Through LLM (CUDA graphs, overlap), per-channel FP8 or bf16: the SwiGLU in the gate_up GEMM's epilogue
    (the default) gives the tokens and logprobs of the fused SiLU-and-mul quantizer path
    (DEEPINFER_DISABLE_SWIGLU_EPILOGUE=1) bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.layers.cuda_ops import DISABLE_SWIGLU_EPILOGUE_ENV
    from deepinfer.engine.layers.mlp import GatedMLP

    from benchmarks.shapes import write_shape

    d = write_shape("qwen2.5-0.5b", tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 150000, (int(n),), generator=gen).tolist() for n in (5, 70, 300, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = {}
    for epilogue in (True, False):
        monkeypatch.setenv(DISABLE_SWIGLU_EPILOGUE_ENV, "0" if epilogue else "1")
        llm = LLM(model=str(d), load_format="dummy", quantization=quantization, deterministic=deterministic,
                  max_model_len=1024, gpu_memory_utilization=0.3)
        mlps = [m for m in llm.model.modules() if isinstance(m, GatedMLP)]
        assert mlps and all(m.swiglu_in_gate_up == epilogue for m in mlps)
        outs[epilogue] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
