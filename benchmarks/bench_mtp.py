"""MTP speculative decoding: verify-step cost at draft lengths 0-3, end-to-end tokens/s with MTP on and off.

Run on an H200 (random weights, `load_format="dummy"`, a DeepSeek-V2-Lite-sized V3-architecture shape with
one MTP layer):
    cd benchmarks && python bench_mtp.py --parts verify --out mtp_verify.json   # ~3-5 min
    cd benchmarks && python bench_mtp.py --parts e2e --out mtp_e2e.json         # ~6-9 min
    cd benchmarks && python bench_mtp.py --quick                                # CPU, tiny shape
Part 1 (`verify`): for each batch size B and draft length k, one target forward over B sequences with 1 + k
query tokens each at context `--context` (+ LM head and the exact sampling of every row), the MTP draft pass
over the same rows, and one chained MTP step (1 token per sequence); median of `--iters` timed calls after
warm-up. `verify_ratio` = verify(k) / verify(0): what MTPConfig.verify_token_cost models (per draft token:
(ratio - 1) / k); `draft_ratio` = draft pass / verify(0): MTPConfig.draft_step_cost.
Part 2 (`e2e`): generate `--num-prompts` prompts with MTP off, then on at max_draft_len 1..3, (a) with the
random MTP layer (acceptance ~0: the overhead; auto-off disabled so it is measured) and (b) with weights
built so the draft always agrees (every block's output projections zeroed, as tests/engine/test_mtp.py's
agreeing checkpoint): 100% acceptance, the upper bound of the speed-up. Greedy; outputs are checked equal.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from common import JsonOut, spread, sync

V3_LITE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
TINY = {**V3_LITE, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 1024, "torch_dtype": "float32"}


def write_model(cfg: dict, root: Path) -> Path:
    from deepinfer.engine.models.demo import write_tokenizer_files

    d = root / "v3-lite-mtp"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    write_tokenizer_files(d)
    return d


@torch.no_grad()
def make_agree(llm) -> None:
    """Zero every output projection (target and MTP) and wire the MTP layer to the target's own prediction:
    the draft's argmax is then the target's (tests/support/tiny_deepseek.py `write_mtp_layer` proves it)."""
    model, draft = llm.model, llm.engine.spec.proposer.draft
    for m in (model, draft):
        for name, p in m.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
    layer, hidden = draft.layer, model.config.hidden_size
    layer.enorm.weight.fill_(1.0)
    layer.eh_proj.weight.zero_()
    layer.eh_proj.weight[:, :hidden].copy_(torch.eye(hidden))
    layer.shared_head.norm.weight.copy_(model.model.norm.weight)
    model.lm_head.weight.mul_(20.0)


def _timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    sync()
    xs = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        xs.append(time.perf_counter() - t)
    return spread(xs)["median"] * 1e3


@torch.inference_mode()
def bench_verify(llm, batch: int, k: int, context: int, iters: int, rng: random.Random) -> dict:
    """ms of a verify step (1 + k tokens per sequence), the draft pass over its rows and one chained step."""
    from deepinfer.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from deepinfer.engine.core.sequence import Sequence
    from deepinfer.engine.sample.params import SamplingParams
    from deepinfer.engine.spec_decode.proposer import single_token_meta
    from deepinfer.engine.spec_decode.verify import sample_and_verify

    runner, spec = llm.engine.runner, llm.engine.spec
    bm, vocab = llm.engine.scheduler.block_manager, llm.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=16)
    seqs = [Sequence(seq_id=10_000_000 + i, params=params, seed=i,
                     prompt_token_ids=[rng.randrange(2, vocab) for _ in range(context)])
            for i in range(batch)]
    for s in seqs:
        bm.allocate(s, context + 4, [])   # the context's KV stays as allocated: timing reads no values
        s.num_computed_tokens = context - 1
    out = SchedulerOutput([ScheduledSequence(s, context - 1, 1 + k, True,
                                             [rng.randrange(2, vocab) for _ in range(k)]) for s in seqs])
    out.num_batched_tokens = batch * (1 + k)
    batch_in = runner.prepare(out)
    state = {}

    def verify() -> None:
        h = runner.model(batch_in.input_ids, batch_in.positions, batch_in.meta, runner.kv_caches)
        logits = runner.model.compute_logits(h[batch_in.sample_indices])[:, :vocab]
        sample_and_verify(runner.sampler, logits, out.scheduled)
        state["h"] = h

    def draft_pass() -> None:
        spec.proposer.draft_pass(out, batch_in.meta, batch_in.positions, state["h"], {})

    meta1 = single_token_meta(seqs, [context - 1] * batch, bm.block_size, runner.device)
    ids1 = torch.zeros(batch, dtype=torch.int64, device=runner.device)

    def chained() -> None:
        y = spec.proposer.draft(ids1, meta1.positions, state["h"][:batch], meta1, spec.proposer.cache)
        spec.proposer.draft.compute_logits(y)

    rec = {"batch": batch, "k": k, "context": context, "verify_ms": _timed(verify, iters),
           "draft_pass_ms": _timed(draft_pass, iters), "chained_step_ms": _timed(chained, iters)}
    for s in seqs:
        bm.free(s)
    return rec


def run_e2e(path: Path, args, prompts: list[list[int]], agree: bool) -> list[dict]:
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.spec_decode.config import MTPConfig

    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    records, ref = [], None
    for k in [0, 1, 2, 3]:
        # Every arm loads the draft (same seeded weights); the plain arm (k = 0) just never drafts.
        mtp = MTPConfig(max_draft_len=max(k, 1), confidence_threshold=0.0, auto_disable=False)
        llm = LLM(str(path), speculative_mtp=mtp, load_format="dummy", device=args.device,
                  max_num_seqs=args.batch)
        if agree:
            make_agree(llm)
        if not k:
            llm.engine.spec.disable("plain arm")
        llm.generate(prompts[: args.batch], sp, use_tqdm=False)   # warm-up
        xs, outs = [], None
        for _ in range(args.runs):
            sync()
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            sync()
            xs.append(time.perf_counter() - t)
        ids = [o.token_ids for o in outs]
        ref = ids if ref is None else ref
        st = llm.get_stats()
        records.append({"agree": agree, "max_draft_len": k, "tok_s": len(prompts) * args.output_len
                        / spread(xs)["median"], "wall_s": spread(xs), "identical_to_plain": ids == ref,
                        **{key: v for key, v in st.items() if key.startswith("spec_")}})
        del llm
        _free()
    return records


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--parts", default="verify,e2e", help="comma list of: verify, e2e")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = V3_LITE
    if args.quick:
        cfg, args.device, args.batches, args.context, args.iters = TINY, "cpu", "1,4", 64, 3
        args.num_prompts, args.batch, args.prompt_len, args.output_len, args.runs = 8, 4, 16, 16, 1
    from deepinfer.engine import LLM
    from deepinfer.engine.spec_decode.config import MTPConfig

    out = JsonOut(args.out)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(cfg, Path(tmp))
        parts = set(args.parts.split(","))
        verify, e2e = [], []
        llm = None
        if "verify" in parts:
            llm = LLM(str(path), load_format="dummy", device=args.device, enable_cuda_graphs=False,
                      speculative_mtp=MTPConfig(auto_disable=False))
        for b in [int(x) for x in args.batches.split(",")] if llm is not None else []:
            base = None
            for k in [0, 1, 2, 3]:
                rec = bench_verify(llm, b, k, args.context, args.iters, rng)
                base = rec["verify_ms"] if k == 0 else base
                rec["verify_ratio"] = rec["verify_ms"] / base
                rec["draft_ratio"] = rec["draft_pass_ms"] / base
                out.line({"part": "verify", **rec})
                verify.append(rec)
        del llm
        _free()
        vocab = cfg["vocab_size"]
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        for agree in (False, True) if "e2e" in parts else ():
            for rec in run_e2e(path, args, prompts, agree):
                out.line({"part": "e2e", **rec})
                e2e.append(rec)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    out.summary({"shape": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                "kv_lora_rank", "num_nextn_predict_layers")},
                 "device": gpu, "args": vars(args), "verify": verify, "e2e": e2e})


if __name__ == "__main__":
    main()
