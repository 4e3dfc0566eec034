"""GPU: DeepSeek-V2/V3 decode steps as CUDA graphs change no bit of any output (deterministic mode).

Tiny random checkpoints (tests/support/tiny_deepseek.py) with room for 2048 positions: V3 (q LoRA, MoE with
sigmoid noaux_tc routing, YaRN) and V2 (no q LoRA, softmax group-limited routing), bf16 and FP8
(quantization="fp8" on hidden-256 copies: block-scaled and rowwise FP8 linears, FP8 routed experts).
Prompts of ~30 to ~1750 tokens put decode rows at 1 to 4 MLA KV splits (bf16 tiles of 32 positions: two
splits from position 512, four from 1536), batch sizes 1, 3, 8 and 17 run in buckets 1, 4, 8 and 32
(padding rows), and requests of several lengths finish at different steps, so batches shrink through
smaller buckets. Greedy and seeded sampling with logprobs: token ids and logprobs equal the eager engine's
(`enable_cuda_graphs=False`, synchronous loop), and get_stats shows graph steps with padding. MTP drafting
that turns itself off mid-run hands its requests to the graph steps without a changed bit. Fast mode
captures and replays too (no bitwise claim: fast mode is not batch-invariant).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from tests.support.cuda_invariance import cuda_llm
from tests.support.tiny_deepseek import make_tiny_deepseek, write_mtp_layer

pytestmark = pytest.mark.gpu

MAX_LEN = 2048
SIZES = (1, 3, 8, 17)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_deepseek_graphs_gpu")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        """"v3" / "v2"; "_wide": hidden 256 (FP8 runs: K of 256 is two 128-column groups, so the block-scaled
        GEMM runs beside the rowwise one that layers of K <= 128 take); "v3_mtp": V3 with a random MTP layer
        (its drafts mostly fail)."""
        if name not in built:
            variant = name.split("_")[0]
            extra = {"hidden_size": 256} if name.endswith("_wide") else {}
            path = make_tiny_deepseek(variant, root / f"{name}_src", max_position_embeddings=MAX_LEN, **extra)
            if name.endswith("_mtp"):
                path = write_mtp_layer(shutil.copytree(path, root / name), seed=1)
            built[name] = str(path)
        return built[name]

    return get


def _requests(n: int, vocab: int):
    from deepinfer.engine import SamplingParams

    rng = random.Random(n)
    base = (30, 600, 1100, 1700)          # decode positions at 1, 2, 3 and 4 splits
    prompts = [[rng.randrange(10, vocab) for _ in range(base[i % 4] + rng.randint(0, 40))] for i in range(n)]
    params = []
    for i in range(n):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=8 + i % 11, ignore_eos=True, logprobs=2))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=6 + 2 * (i % 8),
                                         ignore_eos=True, logprobs=1))
    return prompts, params


def _outputs(llm, n: int) -> list[tuple]:
    prompts, params = _requests(n, llm.model_config.vocab_size)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def _llm(path: str, **kw):
    return cuda_llm(path, max_model_len=MAX_LEN, max_num_seqs=32, num_kv_blocks=4096,
                    enable_prefix_caching=False, **kw)


@pytest.mark.parametrize("variant,quantization,capture", [
    ("v3", None, "startup"),
    ("v2", None, "startup"),
    ("v3_wide", "fp8", "startup"),
    ("v2_wide", "fp8", "startup"),
    ("v3", None, "lazy"),
])
def test_graph_decode_steps_give_the_eager_bits(ckpt, variant, quantization, capture):
    path = ckpt(variant)
    eager = _llm(path, quantization=quantization, enable_cuda_graphs=False, async_scheduling=False)
    assert eager.get_stats()["cuda_graphs_enabled"] is False
    reference = {n: _outputs(eager, n) for n in SIZES}
    del eager
    llm = _llm(path, quantization=quantization, cuda_graph_capture=capture)
    if quantization == "fp8":   # FP8 experts, block-scaled and rowwise FP8 linears
        assert any(m.gate_up_proj.dtype == torch.float8_e4m3fn
                   for m in llm.model.modules() if hasattr(m, "gate_up_scale")), "FP8 experts expected"
        groups = {m.fp8_scale.shape[1] for m in llm.model.modules() if hasattr(m, "fp8_scale")}
        assert groups == {1, 2}, groups
    stats = llm.get_stats()
    assert stats["cuda_graphs_enabled"], stats
    for n in SIZES:
        assert _outputs(llm, n) == reference[n], f"graphs + overlap differ at batch {n}"
    stats = llm.get_stats()
    assert stats["graph_steps"] > 0 and stats["cuda_graph_padded_rows"] > 0, stats
    assert {1, 4, 8, 32} <= set(stats["cuda_graph_buckets"]), stats
    llm.engine.async_scheduling = False              # graphs with the synchronous loop
    assert _outputs(llm, 17) == reference[17], "graphs (sync loop) differ at batch 17"


def test_env_var_turns_deepseek_graphs_off(ckpt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISABLE_CUDA_GRAPHS", "1")
    llm = _llm(ckpt("v2"))
    assert llm.get_stats()["cuda_graphs_enabled"] is False
    _outputs(llm, 3)
    assert llm.get_stats()["graph_steps"] == 0


def test_mtp_turning_itself_off_hands_over_to_graph_steps(ckpt):
    from deepinfer.engine.spec_decode.config import MTPConfig

    path = ckpt("v3_mtp")
    plain = _llm(path, enable_cuda_graphs=False, async_scheduling=False)
    reference = _outputs(plain, 17)
    del plain
    # min_rows above one step's 17 rows: the first steps draft and verify (their drafts, random weights,
    # are rejected), then the policy turns drafting off after 3 steps (51 rows); with min_rows below 17 it
    # turns off in the first step, before any draft is verified.
    llm = _llm(path, speculative_mtp=MTPConfig(confidence_threshold=0.0, min_rows=40))
    assert llm.get_stats()["cuda_graphs_enabled"]
    assert _outputs(llm, 17) == reference
    stats = llm.get_stats()
    assert stats["spec_drafted_tokens"] > 0 and not stats["spec_active"], stats   # drafted, then turned off
    assert stats["graph_steps"] > 0, stats


def test_fast_mode_graphs_capture_and_replay(ckpt):
    """Fast mode's MLA split policy follows the bucket size and its GEMMs are cuBLAS: the graphs must
    capture (no host sync in any op) and replay, and every request gets its tokens."""
    llm = _llm(ckpt("v3"), deterministic=False)
    outs = _outputs(llm, 17)
    _, params = _requests(17, llm.model_config.vocab_size)
    assert [len(t) for t, _ in outs] == [p.max_tokens for p in params]
    stats = llm.get_stats()
    assert stats["cuda_graphs_enabled"] and stats["graph_steps"] > 0, stats
