"""Structured-output cost on the GPU: a JSON schema on every request vs unconstrained, same prompts.

The unconstrained run is given, per request, the number of tokens the constrained run produced.

    python benchmarks/bench_structured.py --shape llama-3.1-8b --num-prompts 256 --out structured.json

Random weights (`load_format="dummy"`), random-token prompts. Constrained requests end when their grammar
completes, so the figure compared is output tokens per second (and seconds per engine step), not
wall time. Also reports the schema's compile time (first compile, then a cache hit).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from shapes import write_shape

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


def run(llm, prompts, params) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "out_tok_s": n / dt, "outputs": outs}


def mask_costs(llm, params, vocab: int, steps: int = 20) -> dict:
    """Host-side cost per step of the constrained batch alone: mask fill, mask apply, matcher advance."""
    from deepinfer.engine.core.sequence import Sequence

    m = llm.structured
    seqs = [Sequence(seq_id=i, prompt_token_ids=[5] * 8, params=p, seed=i) for i, p in enumerate(params)]
    for s in seqs:
        m.add(s)
    g = torch.Generator(device="cuda").manual_seed(0)
    tot = {"fill": 0.0, "apply": 0.0, "accept": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        job = m.masks_for(seqs)
        job.wait()
        t1 = time.perf_counter()
        logits = torch.randn(len(seqs), vocab, device="cuda", generator=g)
        torch.cuda.synchronize()
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
    return {k: 1000 * v / steps for k, v in tot.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from deepinfer.engine import LLM, SamplingParams

    from tests.support.check import output_satisfies

    model_dir = write_shape(args.shape, Path(tempfile.mkdtemp()))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (args.num_prompts, args.prompt_len), generator=g).tolist()
    llm = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy",
              max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.num_prompts,
              gpu_memory_utilization=0.85)
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
    free = run(llm, prompts, sp_free)
    cons = run(llm, prompts, sp_json)
    assert [o.token_ids for o in cons["outputs"]] == [o.token_ids for o in warm["outputs"]]
    finished = [o for o in cons["outputs"] if o.finish_reason == "stop"]
    valid = sum(output_satisfies("json_schema", SCHEMA, o.text) for o in finished)
    costs = mask_costs(llm, sp_json, vocab)
    result = {
        "host_costs_ms_per_step": costs,
        "shape": args.shape, "gpu": torch.cuda.get_device_name(), "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "manager_build_s": build_s, "schema_compile_s": compile_s, "schema_cached_s": cached_s,
        "json_schema_first_pass_s": warm["seconds"],
        "unconstrained": {k: v for k, v in free.items() if k != "outputs"},
        "json_schema": {k: v for k, v in cons.items() if k != "outputs"},
        "finished": len(finished), "finished_valid": valid,
        "slowdown": 1 - cons["out_tok_s"] / free["out_tok_s"],
    }
    print(json.dumps(result, indent=1))
    print("example:", cons["outputs"][0].text[:200])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
