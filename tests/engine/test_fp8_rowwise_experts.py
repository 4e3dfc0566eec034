"""quantization="fp8-channel" (per-channel FP8, rowwise GEMM) and FP8 routed experts, loaded on CPU through
the CUDA loading path (fp8_compute forced on; `Ops` runs the plain references): plans, the spec key,
quantize-at-load equal to an offline "FP8-Dynamic" checkpoint, and layers holding exactly the checkpoint's
weights (tiny Llama and tiny DeepSeek-V3, float32)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import yaml
from deepinfer.engine import LLM
from deepinfer.engine.models.quant.fp8_format import checkpoint_format, plan_quantization
from deepinfer.engine.models.quant.fp8_tensor import quantize_fp8_channel

from tests.support.fp8_checkpoints import quantize_rows, write_dequantized_copy, write_fp8_copy
from tests.support.tiny_deepseek import make_tiny_deepseek


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8rw")
    llama = tiny_checkpoint("llama")
    v3 = make_tiny_deepseek("v3", root / "v3-src")
    v3_fp8 = write_fp8_copy(v3, root / "v3-block", "block", (16, 16))
    return {"llama": llama, "llama-channel": write_fp8_copy(llama, root / "llama-channel", "channel", (1, 1)),
            "v3": v3, "v3-block": v3_fp8, "v3-block-deq": write_dequantized_copy(v3_fp8, root / "v3-deq")}


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, **kw)


def _fp8_model(path, quantization: str):
    """The model as LLM builds it on CUDA (FP8 parameters), here on CPU."""
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.quant.fp8_format import read_checkpoint_format
    from deepinfer.engine.models.quant.fp8_loading import load_with_plan
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    plan = replace(plan_quantization(quantization, read_checkpoint_format(path), "cpu"), fp8_compute=True)
    model = build_model(cfg, make_ops("cpu", True), torch.float32, "cpu")
    load_with_plan(model, iter_weights(path, "cpu"), plan)
    return model, cfg, plan


def test_plans_and_errors():
    channel = checkpoint_format({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}})
    block = checkpoint_format({"quantization_config": {"quant_method": "fp8",
                                                       "weight_block_size": [128, 128]}})
    plan = plan_quantization("fp8-channel", None, "cuda")
    assert plan.rowwise and plan.quantize_at_load and plan.fp8_compute and plan.layer_group(4096) == 4096
    assert plan_quantization("auto", channel, "cuda").rowwise
    assert plan_quantization("fp8", channel, "cuda").rowwise                # the checkpoint's scheme wins
    assert not plan_quantization("fp8", None, "cuda").rowwise
    assert plan_quantization("auto", block, "cuda").layer_group(4096) == 128
    with pytest.raises(ValueError, match="block-scaled FP8.*quantization='auto'"):
        plan_quantization("fp8-channel", block, "cuda")
    with pytest.raises(ValueError, match="'fp8-channel'"):
        plan_quantization("fp8_channel", None, "cuda")


def test_spec_accepts_fp8_channel(tmp_path):
    from deepinfer.pipeline.spec.load import load_spec
    from deepinfer.pipeline.spec.schema import SpecError

    doc = {"model": {"name": "demo", "quantization": "fp8-channel"},
           "input": {"path": "data/in.jsonl", "format": "jsonl", "id_column": "id"},
           "prompt": {"template": "Classify: {{ text }}"}, "output": {"path": "out"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert load_spec(path).engine_kwargs()["quantization"] == "fp8-channel"
    bad = copy.deepcopy(doc)
    bad["model"]["quantization"] = "fp8-rowwise"
    path.write_text(yaml.safe_dump(bad), encoding="utf-8")
    with pytest.raises(SpecError):
        load_spec(path)


def test_channel_quantizer_is_the_fp8_dynamic_writer():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=gen) * 0.1
    w[3] = 0.0
    q, s = quantize_fp8_channel(w)
    q_ref, s_ref = quantize_rows(w, per_tensor=False)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_quantize_at_load_per_channel_equals_offline_checkpoint(dirs):
    a, b = _llm(dirs["llama"], quantization="fp8-channel"), _llm(dirs["llama-channel"], quantization="auto")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    # And on the FP8 path: the same e4m3 weights and [N, 1] scales, one K-group spanning each layer's K.
    online, cfg, _ = _fp8_model(dirs["llama"], "fp8-channel")
    offline, _, _ = _fp8_model(dirs["llama-channel"], "auto")
    off = dict(offline.named_modules())
    seen = 0
    for name, module in online.named_modules():
        if getattr(module, "fp8_scale", None) is None:
            continue
        seen += 1
        assert module.fp8_scale.shape == (module.weight.shape[0], 1)
        assert module.fp8_group == module.weight.shape[1]
        assert torch.equal(module.weight.view(torch.uint8), off[name].weight.view(torch.uint8)), name
        assert torch.equal(module.fp8_scale, off[name].fp8_scale), name
    assert seen == 4 * cfg.num_hidden_layers


def test_fp8_experts_hold_the_checkpoint_weights_and_run(dirs):
    from tests.support.paged_runner import prefill_rel_error

    model, cfg, plan = _fp8_model(dirs["v3-block"], "auto")
    dense = _llm(dirs["v3-block-deq"]).model
    dense_params = dict(dense.named_parameters())
    converted = 0
    for name, module in model.named_modules():
        if not hasattr(module, "gate_up_scale"):
            continue
        converted += 1
        for pname, sname in (("gate_up_proj", "gate_up_scale"), ("down_proj", "down_scale")):
            q, scale = getattr(module, pname), getattr(module, sname)
            assert q.dtype == torch.float8_e4m3fn
            full = scale.repeat_interleave(module.fp8_group, 2)[..., :q.shape[2]]
            assert torch.equal(q.float() * full, dense_params[f"{name}.{pname}"]), (name, pname)
    assert converted == cfg.num_hidden_layers - cfg.moe.first_k_dense_replace
    ids = [5, 17, 3, 40, 22, 9, 31]
    got, rel = prefill_rel_error(model, dense, cfg, ids)
    assert torch.isfinite(got).all() and float(rel.median()) < 0.15


def test_dummy_init_with_fp8_experts_and_rowwise_linears(dirs):
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.quant.fp8_loading import init_dummy_with_plan
    from deepinfer.engine.models.registry import build_model

    from tests.support.paged_runner import PagedBatchRunner

    for path, quantization in ((dirs["v3"], "fp8"), (dirs["llama"], "fp8-channel")):
        cfg = ModelConfig.from_dir(path)
        plan = replace(plan_quantization(quantization, None, "cpu"), fp8_compute=True)
        model = build_model(cfg, make_ops("cpu", True), torch.float32, "cpu")
        init_dummy_with_plan(model, plan, seed=0)
        fp8 = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert any(n.endswith("experts.gate_up_proj") for n in fp8) == (quantization == "fp8")
        for name, module in model.named_modules():      # every FP8 weight's scales were written
            if hasattr(module, "gate_up_scale"):
                q, scale = module.gate_up_proj, module.gate_up_scale
                w = q.float() * scale.repeat_interleave(module.fp8_group, 2)[..., :q.shape[2]]
                assert torch.isfinite(w).all() and w.abs().max() > 0, name
        runner = PagedBatchRunner(model, cfg)
        runner.add("a", [3, 8, 13])
        assert torch.isfinite(runner.step([("a", 3)])["a"]).all()
