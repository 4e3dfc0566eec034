"""Structured-output cost on the GPU: a JSON schema on every request vs unconstrained, same prompts.

The unconstrained run is given, per request, the number of tokens the constrained run produced.

    python benchmarks/bench_structured.py --shape llama-3.1-8b --num-prompts 256 --out structured.json

Random weights (`load_format="dummy"`), random-token prompts. Constrained requests end when their grammar
completes, so the figure compared is output tokens per second (and seconds per engine step), not
wall time. Also reports the schema's compile time (first compile, then a cache hit).

Vocabulary: by default a real 128,256-entry byte-level BPE trained with `tokenizers` (bigtok.py: the
shipped corpus expanded deterministically, cached under the temp dir), and the model's vocab_size is the
tokenizer's, so every logits column is a real token the grammar must decide on. `--tokenizer demo` uses the
earlier setup (the 576-id demo BPE inside a 128,256-wide row) for comparison with older results.
After a warm-up of each arm, the arms alternate (unconstrained, constrained, unconstrained, ...) for
`--runs` pairs; medians, min/max and the median of the per-pair slowdowns are reported. Needs llguidance.

Mask filling is reported per constrained run: worker time filling masks per step (`fill_ms_per_step`), the
part of it sampling had to wait for (`wait_ms_per_step`: not hidden behind the forward and the host's other
work) and `overlapped_fraction` = 1 - wait / fill, as means and, per masked step, median / p90 / max
(`per_step`: a few slow steps, e.g. the one where every row is in the initial state, can dominate the
mean). `mask_cache` gives the exact mask cache's share of rows served by copy (a stored mask of the same
grammar state or token history, or a row of the same fill batch) instead of llguidance. `--prefetch-ab`
adds an arm with the prefetch off (masks filled only when the step samples, the earlier behaviour; same
outputs); `--mask-cache-ab` one with the mask cache off (every row computed by llguidance; same outputs);
`--state-keys-ab` one with the cache keyed by token history only (no grammar-state keys, state_key.py; same
outputs); `--inline-hits-ab` one with stored masks copied by the mask worker instead of on the engine thread
when the fill is queued (mask_slots.py; same outputs).
The measured runs repeat the warm-up's requests, so by default they find the masks the earlier
runs stored, also for states no other request would share (a number being written); `--cold-cache` empties
the mask cache before every constrained run (each run then starts like the first batch of a job): the two
bound the steady state of a job whose requests differ.

`--device cpu` is a quick host-side check on a small machine: a 2-layer Llama of the 8B shape's vocabulary
(the 128k BPE), float32, e.g. `--device cpu --num-prompts 16 --prompt-len 32 --max-tokens 32 --runs 3`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import JsonOut, StepRecorder, spread, sync
from shapes import SHAPES, write_shape

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["label", "confidence", "topics", "summary"],
    "additionalProperties": False,
}


# CPU check: the 8B shape's vocabulary and layer type at a size a 2-core machine runs in seconds.
CPU_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "float32"}

# --*-ab flag -> (the constrained arm run with that part switched off (set_arm), the key of the
# constrained arm's speedup over it, per interleaved pair)
AB_ARMS = {"prefetch_ab": ("json_schema_no_prefetch", "prefetch_speedup_pairs"),
           "mask_cache_ab": ("json_schema_no_mask_cache", "mask_cache_speedup_pairs"),
           "state_keys_ab": ("json_schema_no_state_keys", "state_keys_speedup_pairs"),
           "inline_hits_ab": ("json_schema_no_inline_hits", "inline_hits_speedup_pairs")}


def model_dir_for(shape: str, tokenizer: str, root: Path, cpu: bool = False) -> Path:
    """The shape's config + tokenizer; with the 128k BPE, vocab_size is the tokenizer's own size."""
    if cpu:
        SHAPES[f"{shape}-cpu"] = dict(SHAPES[shape], **CPU_SHAPE)
        shape = f"{shape}-cpu"
    if tokenizer == "demo":
        return write_shape(shape, root)
    import shutil

    from bigtok import build_tokenizer_dir

    tok_dir = build_tokenizer_dir()
    d = root / f"{shape}-bpe"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, d / name)
    vocab = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = dict(SHAPES[shape], vocab_size=vocab)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    return d


def run(llm, prompts, params, rec: StepRecorder | None = None) -> dict:
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    if rec is not None:
        rec.end()
    n = sum(len(o.token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "out_tok_s": n / dt, "outputs": outs}


def set_arm(llm, arm: str, cold_cache: bool) -> None:
    """The structured-output settings of one arm (all give the same outputs)."""
    m = llm.structured
    m.prefetch = arm != "json_schema_no_prefetch"
    m.use_mask_cache(arm != "json_schema_no_mask_cache")
    m.state_keys = arm != "json_schema_no_state_keys"  # read when a request's grammar state is made
    m.slots.inline_hits = arm != "json_schema_no_inline_hits"
    if cold_cache and arm != "unconstrained":
        m.slots.wait_idle()
        m.mask_cache.clear()


def mask_counters(llm) -> dict:
    return {**llm.structured.mask_stats(), "step_log_len": len(llm.structured.step_log)}


def _dist(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "max": xs[-1]}


def mask_summary(llm, before: dict, after: dict) -> dict:
    """Per-step mask figures of one run from the manager's cumulative counters and its per-step log."""
    steps = max(1, after["mask_steps"] - before["mask_steps"])
    fill = after["fill_seconds"] - before["fill_seconds"]
    wait = after["wait_seconds"] - before["wait_seconds"]
    log = llm.structured.step_log[before["step_log_len"]:after["step_log_len"]]
    lookups = after["mask_cache_lookups"] - before["mask_cache_lookups"]
    reused = (after["mask_cache_hits"] - before["mask_cache_hits"]
              + after["mask_cache_shared"] - before["mask_cache_shared"])
    rows = after["filled_rows"] - before["filled_rows"]
    inline = after["inline_rows"] - before["inline_rows"]
    return {"steps": steps, "rows_per_step": (after["mask_rows"] - before["mask_rows"]) / steps,
            "fill_ms_per_step": 1000 * fill / steps, "wait_ms_per_step": 1000 * wait / steps,
            "overlapped_fraction": max(0.0, 1 - wait / fill) if fill > 0 else 0.0,
            "per_step": {"fill_ms": _dist([1000 * f for f, _, _ in log]),
                         "wait_ms": _dist([1000 * w for _, w, _ in log]),
                         "rows": _dist([float(r) for _, _, r in log])},
            "mask_cache": {"rows_filled": rows, "rows_by_copy": reused,
                           "hit_rate": reused / rows if rows else 0.0,
                           "copied_at_submit": inline / rows if rows else 0.0,
                           "hit_rate_of_lookups": reused / lookups if lookups else 0.0,
                           "masks_kept": after["mask_cache_masks"],
                           "state_masks_kept": after["mask_cache_state_masks"],
                           "trie_nodes": after["mask_cache_nodes"]}}


def mask_costs(llm, params, vocab: int, steps: int = 20) -> dict:
    """Host-side cost per step of the constrained batch alone: mask fill, mask apply, matcher advance."""
    from deepinfer.engine.core.sequence import Sequence

    m = llm.structured
    m.prefetch = False  # each step's fill is timed alone, from masks_for to the fill's end
    seqs = [Sequence(seq_id=i, prompt_token_ids=[5] * 8, params=p, seed=i) for i, p in enumerate(params)]
    for s in seqs:
        m.add(s)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tot = {"fill": 0.0, "apply": 0.0, "accept": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        job = m.masks_for(seqs)
        job.wait()
        t1 = time.perf_counter()
        logits = torch.randn(len(seqs), vocab, device=dev, generator=g)
        sync()
        t2 = time.perf_counter()
        job.apply(logits)
        toks = logits.argmax(-1).tolist()
        t3 = time.perf_counter()
        for s, tok in zip(seqs, toks):
            if not m.is_terminated(s.grammar):
                m.advance(s, tok)
                s.output_token_ids.append(tok)
        t4 = time.perf_counter()
        tot["fill"] += t1 - t0
        tot["apply"] += t3 - t2
        tot["accept"] += t4 - t3
    m.prefetch = True
    for s in seqs:
        m.free(s)
    return {k: 1000 * v / steps for k, v in tot.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tokenizer", choices=["bpe128k", "demo"], default="bpe128k")
    ap.add_argument("--runs", type=int, default=3, help="measured (unconstrained, constrained) pairs")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--prefetch-ab", action="store_true",
                    help="a third arm: JSON schema with the mask prefetch off (filled at sampling only)")
    ap.add_argument("--mask-cache-ab", action="store_true",
                    help="an arm: JSON schema with the exact mask cache off (every row from llguidance)")
    ap.add_argument("--state-keys-ab", action="store_true",
                    help="an arm: JSON schema with the mask cache keyed by token history only")
    ap.add_argument("--inline-hits-ab", action="store_true",
                    help="an arm: JSON schema with stored masks copied by the mask worker, not at submit")
    ap.add_argument("--cold-cache", action="store_true",
                    help="empty the mask cache before every constrained run")
    ap.add_argument("--profile-steps", action="store_true",
                    help="one more profiled pair: GPU busy fraction and host ms per decode step")
    ap.add_argument("--out", default=None, help="summary JSON here, one line per run in OUT.jsonl")
    args = ap.parse_args()

    from deepinfer.engine import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.support
    from tests.support.check import output_satisfies  # needs jsonschema

    out = JsonOut(args.out)
    t0 = time.perf_counter()
    cpu = args.device == "cpu"
    model_dir = model_dir_for(args.shape, args.tokenizer, Path(tempfile.mkdtemp()), cpu=cpu)
    tokenizer_s = time.perf_counter() - t0
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (args.num_prompts, args.prompt_len), generator=g).tolist()
    extra = {} if cpu else {"gpu_memory_utilization": 0.85}
    llm = LLM(model=str(model_dir), dtype="float32" if cpu else "bfloat16", device=args.device,
              load_format="dummy", max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=args.num_prompts, **extra)
    rec = StepRecorder(llm)
    t0 = time.perf_counter()
    _ = llm.structured  # the manager is built here (tokenizer vocabulary processing)
    build_s = time.perf_counter() - t0
    sp_json = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, json_schema=SCHEMA)
               for i in range(args.num_prompts)]
    t0 = time.perf_counter()
    llm.structured.validate(sp_json[0])
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.structured.validate(sp_json[1])
    cached_s = time.perf_counter() - t0
    # A full constrained pass first: it warms every kernel shape and gives each request's length.
    warm = run(llm, prompts, sp_json)
    # The unconstrained run generates exactly as many tokens per request as the constrained one did, so
    # both runs have the same batch shape at every step and the difference is the cost of the masks.
    sp_free = [SamplingParams(temperature=1.0, seed=i, max_tokens=max(1, len(o.token_ids)), ignore_eos=True)
               for i, o in enumerate(warm["outputs"])]
    run(llm, prompts, sp_free)  # warm-up of the unconstrained arm
    arms = {"unconstrained": sp_free, "json_schema": sp_json}
    for flag, (arm, _) in AB_ARMS.items():
        if getattr(args, flag):
            arms[arm] = sp_json
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    steps: dict[str, dict] = {}
    masks: dict[str, list[dict]] = {a: [] for a in arms if a != "unconstrained"}
    cons = None
    for i in range(args.runs):
        for arm, params in arms.items():  # ABAB...: drift on a shared machine falls on both arms alike
            rec.reset()
            set_arm(llm, arm, args.cold_cache)
            before = mask_counters(llm)
            r = run(llm, prompts, params, rec)
            steps[arm] = rec.host_summary()
            row = {k: v for k, v in r.items() if k != "outputs"}
            if arm != "unconstrained":
                assert [o.token_ids for o in r["outputs"]] == [o.token_ids for o in warm["outputs"]]
                cons = r if arm == "json_schema" else cons
                row["masks"] = mask_summary(llm, before, mask_counters(llm))
                masks[arm].append(row["masks"])
            runs[arm].append(row)
            out.line({"arm": arm, "run": i, **row})
    finished = [o for o in cons["outputs"] if o.finish_reason == "stop"]
    valid = sum(output_satisfies("json_schema", SCHEMA, o.text) for o in finished)
    set_arm(llm, "json_schema", False)
    costs = mask_costs(llm, sp_json, vocab)
    tps = {a: [r["out_tok_s"] for r in rs] for a, rs in runs.items()}
    pair_slowdowns = [1 - c / f for f, c in zip(tps["unconstrained"], tps["json_schema"])]
    result = {
        "bench": "structured", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host_costs_ms_per_step": costs, "tokenizer": args.tokenizer, "vocab_size": vocab,
        "tokenizer_build_s": tokenizer_s,
        "shape": args.shape + ("-cpu" if cpu else ""), "num_prompts": args.num_prompts,
        "gpu": torch.cuda.get_device_name() if not cpu else None,
        "cpu_threads": torch.get_num_threads(), "mask_threads": llm.structured.backend.threads,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "runs": args.runs,
        "cold_cache": args.cold_cache,
        "manager_build_s": build_s, "schema_compile_s": compile_s, "schema_cached_s": cached_s,
        "json_schema_first_pass_s": warm["seconds"],
        "unconstrained": {"seconds": spread([r["seconds"] for r in runs["unconstrained"]]),
                          "out_tok_s": spread(tps["unconstrained"]), "steps": steps.get("unconstrained")},
        "json_schema": {"seconds": spread([r["seconds"] for r in runs["json_schema"]]),
                        "out_tok_s": spread(tps["json_schema"]), "steps": steps.get("json_schema"),
                        "output_tokens": cons["output_tokens"]},
        "finished": len(finished), "finished_valid": valid,
        "slowdown": 1 - statistics.median(tps["json_schema"]) / statistics.median(tps["unconstrained"]),
        "pair_slowdowns": spread(pair_slowdowns),
        "masks": {arm: {**{k: spread([m[k] for m in ms]) for k in ("fill_ms_per_step", "wait_ms_per_step",
                                                                   "overlapped_fraction", "rows_per_step")},
                        "fill_ms_step_median": spread([m["per_step"]["fill_ms"]["median"] for m in ms]),
                        "fill_ms_step_p90": spread([m["per_step"]["fill_ms"]["p90"] for m in ms]),
                        "wait_ms_step_median": spread([m["per_step"]["wait_ms"]["median"] for m in ms]),
                        "wait_ms_step_p90": spread([m["per_step"]["wait_ms"]["p90"] for m in ms]),
                        "mask_cache_hit_rate": spread([m["mask_cache"]["hit_rate"] for m in ms])}
                  for arm, ms in masks.items()},
    }
    for flag, (arm, speedup) in AB_ARMS.items():
        if getattr(args, flag):
            off = [r["out_tok_s"] for r in runs[arm]]
            result[arm] = {"out_tok_s": spread(off), "steps": steps.get(arm),
                           speedup: spread([c / o for c, o in zip(tps["json_schema"], off)])}
    if args.profile_steps:
        prof: dict[str, dict] = {}
        for arm, params in arms.items():
            rec.reset()
            set_arm(llm, arm, args.cold_cache)
            with rec.profiled():
                run(llm, prompts, params, rec)
            prof[arm] = {"per_step": rec.gpu_busy, "top_kernels": rec.profile_table}
        result["profile"] = prof
    print("example:", cons["outputs"][0].text[:200])
    out.summary(result)


if __name__ == "__main__":
    main()
