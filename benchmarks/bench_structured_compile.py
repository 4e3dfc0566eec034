"""Measure the two grammar libraries (xgrammar, llguidance) on deepinfer's own constraint table.

For every case of `tests.support.spec_catalog` and each library this measures, on the CPU:
  * compile: building the grammar for the spec, cold (xgrammar: a compiler with its cache off;
    llguidance: grammar text + `LLMatcher` construction), and the first mask (llguidance builds its lexer
    lazily, so compile + first mask is the fair "time to first token mask");
  * mask: the mean time to fill one token bitmask row while a seeded random walk (a token drawn uniformly
    among the allowed ones at each step) generates up to the case's token budget, `--walks` times;
  * coverage: whether the library refuses the spec, and for the accepted ones how many finished walks fail
    validation (jsonschema / re.fullmatch / choice membership): a non-zero count means the library silently
    ignored a constraint;
  * the rejected table: whether each spec that must be refused is refused (by the library alone);
  * finish rates: deepinfer's own StructuredOutputManager (llguidance) on the same table, random walks at
    temperature 1.0, share finishing within max_tokens with and without budget steering (steering.py).

Both libraries get the same tokenizer, vocab size (the tokenizer's, padded by `--pad-vocab` ids that must
stay masked) and compact JSON (no free whitespace), so the figures compare like with like.

Run:  python benchmarks/bench_structured_compile.py [--tokenizer path/to/tokenizer.json] [--walks 5]
With no --tokenizer the demo tokenizer (512 tokens) is used; pass a real model's tokenizer.json
(e.g. 128k tokens) for realistic mask times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from deepinfer.engine.structured.normalize import prepare_json_schema, prepare_regex
from tokenizers import Tokenizer

from tests.support.check import output_satisfies
from tests.support.spec_catalog import ALL_CASES, REJECTED_CASES, SpecCase

SEPARATORS = (", ", ": ")


def choice_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def prepared(case: SpecCase, normalize: bool) -> SpecCase:
    """The case as deepinfer hands it to the library: normalize.py's rewrites (applied to both libraries)."""
    if not normalize:
        return case
    if case.kind == "json_schema":
        return SpecCase(case.name, case.kind, prepare_json_schema(case.spec), case.max_tokens)
    if case.kind == "regex":
        return SpecCase(case.name, case.kind, prepare_regex(case.spec), case.max_tokens)
    return case


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tok_json: str, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = json.loads(tok_json)
        encoded = [""] * vocab_size
        for token, i in vocab["model"]["vocab"].items():
            encoded[i] = token
        for added in vocab.get("added_tokens", []):
            # An empty entry is a special token for xgrammar: never allowed as text.
            encoded[added["id"]] = "" if added.get("special") else added["content"]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=eos)
        self.vocab_size = vocab_size

    def compile(self, case: SpecCase):
        comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if case.kind == "json_schema":
            spec = json.dumps(case.spec)
            return comp.compile_json_schema(spec, any_whitespace=False, separators=SEPARATORS)
        if case.kind == "regex":
            return comp.compile_regex(case.spec)
        return comp.compile_grammar(choice_ebnf(case.spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tok_json: str, vocab_size: int, eos: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, case: SpecCase):
        L = self.llg.LLMatcher
        if case.kind == "json_schema":
            opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                    "key_separator": SEPARATORS[1]}
            grammar = L.grammar_from_json_schema(case.spec, overrides=opts)
        elif case.kind == "regex":
            grammar = L.grammar_from_regex(case.spec)
        else:
            grammar = L.grammar_from_lark(choice_lark(case.spec))
        m = L(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor) -> None:
        # llguidance.torch's helper does the same, but importing it pulls in torch.compile (seconds).
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


def is_valid(case: SpecCase, text: str) -> bool:
    return output_satisfies(case.kind, case.spec, text)


def random_walk(lib, compiled, case: SpecCase, tok: Tokenizer, seed: int) -> tuple[str | None, list[float]]:
    """One walk; returns (text if the grammar terminated within budget else None, per-token mask seconds)."""
    gen = torch.Generator().manual_seed(seed)
    m = lib.matcher(compiled)
    bitmask = torch.zeros((1, (lib.vocab_size + 31) // 32), dtype=torch.int32)
    ids: list[int] = []
    times: list[float] = []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(case.max_tokens):
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        times.append(time.perf_counter() - t0)
        allowed = ((bitmask[0].unsqueeze(1) >> shifts) & 1).flatten()[: lib.vocab_size].bool()
        logits = torch.rand(lib.vocab_size, generator=gen).masked_fill(~allowed, -1.0)
        token = int(logits.argmax())
        if not lib.accept(m, token):
            return None, times
        ids.append(token)
        if lib.done(m):
            return tok.decode(ids, skip_special_tokens=True), times
    return None, times


def measure(lib, cases, tok: Tokenizer, walks: int, normalize: bool) -> dict:
    rows = []
    for case in cases:
        row = {"case": case.name}
        t0 = time.perf_counter()
        try:
            compiled = lib.compile(prepared(case, normalize))
        except Exception as e:  # noqa: BLE001 - a refusal is a measurement, whatever the library raises
            row["refused"] = str(e).strip().splitlines()[-1][:100]
            rows.append(row)
            continue
        row["compile_ms"] = (time.perf_counter() - t0) * 1e3
        m = lib.matcher(compiled)
        bm = torch.zeros((1, (lib.vocab_size + 31) // 32), dtype=torch.int32)
        t0 = time.perf_counter()
        lib.fill(m, bm)
        row["first_mask_ms"] = (time.perf_counter() - t0) * 1e3
        finished = invalid = 0
        mask_times: list[float] = []
        for w in range(walks):
            text, times = random_walk(lib, compiled, case, tok, seed=1000 * w + 7)
            mask_times += times
            if text is not None:
                finished += 1
                invalid += not is_valid(case, text)
        row.update(mask_us=statistics.mean(mask_times) * 1e6, finished=finished, invalid=invalid, walks=walks)
        rows.append(row)
    return {"rows": rows}


def summarize(name: str, result: dict) -> str:
    rows = result["rows"]
    ok = [r for r in rows if "refused" not in r]
    lines = [f"== {name}: accepted {len(ok)}/{len(rows)} cases"]
    for r in rows:
        if "refused" in r:
            lines.append(f"  {r['case']:<28} REFUSED  {r['refused']}")
        else:
            lines.append(
                f"  {r['case']:<28} compile {r['compile_ms']:7.2f} ms"
                f"  first mask {r['first_mask_ms']:6.2f} ms  mask {r['mask_us']:7.1f} us"
                f"  finished {r['finished']}/{r['walks']}  invalid {r['invalid']}"
            )
    if ok:
        lines.append(
            f"  median compile {statistics.median(r['compile_ms'] for r in ok):.2f} ms, "
            f"median first mask {statistics.median(r['first_mask_ms'] for r in ok):.2f} ms, "
            f"mean mask {statistics.mean(r['mask_us'] for r in ok):.1f} us/token, "
            f"invalid outputs {sum(r['invalid'] for r in ok)}"
        )
    return "\n".join(lines)


def rejected_table(lib) -> str:
    lines = [f"== {lib.name}: specs that must be refused"]
    refused = 0
    # Specs that are not JSON at all are refused before any library sees them; they say nothing here.
    cases = [c for c in REJECTED_CASES if "not representable" not in c.message]
    for case in cases:
        try:
            lib.compile(SpecCase(case.name, case.kind, case.spec))
            lines.append(f"  {case.name:<28} ACCEPTED (silently not enforced, or an invalid spec taken)")
        except Exception as e:  # noqa: BLE001
            refused += 1
            lines.append(f"  {case.name:<28} refused: {str(e).strip().splitlines()[-1][:90]}")
    lines.append(f"  refused {refused}/{len(cases)}")
    return "\n".join(lines)


def finish_rates(tokenizer_path: Path, vocab_size: int, eos: list[int], walks: int) -> str:
    """deepinfer's manager on the table: share of random walks that finish within max_tokens, and validity."""
    from deepinfer.engine import SamplingParams
    from deepinfer.engine.structured.manager import StructuredOutputManager

    from tests.support.random_walk import random_walks

    tok = Tokenizer.from_file(str(tokenizer_path))
    lines = [f"== deepinfer StructuredOutputManager: {walks} walks per case at temperature 1.0"]
    for steering in (False, True):
        manager = StructuredOutputManager(tokenizer_path, vocab_size, eos, steering=steering)
        finished = total = invalid = 0
        short = []
        t0 = time.perf_counter()
        for case in ALL_CASES:
            params = [SamplingParams(max_tokens=case.max_tokens, **{case.kind: case.spec})] * walks
            results = random_walks(manager, params, lambda ids: tok.decode(ids, skip_special_tokens=True))
            done = [r for r in results if r.finish_reason == "stop"]
            finished += len(done)
            total += len(results)
            invalid += sum(not output_satisfies(case.kind, case.spec, r.text) for r in done)
            if len(done) < walks:
                short.append(f"{case.name} {len(done)}/{walks}")
        manager.close()
        lines.append(
            f"  steering={'on ' if steering else 'off'}  finished within budget {finished}/{total} "
            f"({100 * finished / total:.1f}%), invalid finished outputs {invalid}, "
            f"{time.perf_counter() - t0:.1f} s"
        )
        lines.append(f"    cases not always finished: {', '.join(short) or 'none'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the demo tokenizer)")
    ap.add_argument("--pad-vocab", type=int, default=64, help="model vocab = tokenizer vocab + this")
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--raw", action="store_true", help="give the libraries the specs without normalize.py")
    ap.add_argument("--finish-walks", type=int, default=8,
                    help="walks per case for the finish rates (0: skip)")
    args = ap.parse_args()
    # The walks' torch ops are tiny; OpenMP threads spinning beside the grammar threads only add noise.
    torch.set_num_threads(1)
    if args.tokenizer is None:
        from deepinfer.engine.models.demo import write_tokenizer_files

        tmp = Path(tempfile.mkdtemp())
        write_tokenizer_files(tmp)
        args.tokenizer = tmp / "tokenizer.json"
    tok_json = args.tokenizer.read_text(encoding="utf-8")
    tok = Tokenizer.from_str(tok_json)
    vocab_size = tok.get_vocab_size(with_added_tokens=True) + args.pad_vocab
    specials = tok.get_vocab(with_added_tokens=True).items()
    eos = sorted(i for t, i in specials if "end" in t and t.startswith("<|"))
    print(f"tokenizer {args.tokenizer} ({tok.get_vocab_size()} tokens, model vocab {vocab_size}, eos {eos}), "
          f"torch threads {torch.get_num_threads()}, specs {'raw' if args.raw else 'normalized'}")
    libs = {"xgrammar": XGrammarLib, "llguidance": LLGuidanceLib}
    for name in [n for n in args.libs.split(",") if n]:
        t0 = time.perf_counter()
        lib = libs[name](tok_json, vocab_size, eos)
        print(f"{name}: tokenizer info built in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        print(summarize(name, measure(lib, ALL_CASES, tok, args.walks, normalize=not args.raw)))
        print(rejected_table(lib))
    if args.finish_walks:
        print(finish_rates(args.tokenizer, vocab_size, eos, args.finish_walks))


if __name__ == "__main__":
    main()
