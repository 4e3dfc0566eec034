"""CPU probe of grammar-mask filling for bench_structured's JSON schema on the 128k BPE (no GPU, no model).

    python3 benchmarks/fillprobe.py steps  [--rows 147] [--cache state|history|none] [--threads 1]
                                           [--batches 2] [--check] [--by-state | --prefetch]
    python3 benchmarks/fillprobe.py states [--rows 40]

`steps`: ROWS requests start together (a batch of new requests, as in the benchmark) and walk by uniformly
random allowed tokens through the real StructuredOutputManager (masks_for / advance / free, mask prefetch
off so each step's fill is timed alone, steering off) until they finish or reach --max-tokens; then the next
batch of ROWS starts, on the caches the first left (`--batches`: batch 1 is the cold start, later ones the
steady state the benchmark's measured runs see after its warm-up pass). Per step: fill wall ms (from
masks_for to the last row written), fill CPU ms (process CPU time over the same window: llguidance's
threads included, and unlike wall time not inflated by other load on a shared machine), and the
engine-thread CPU ms of `advance` for the step's rows (matcher advance + state-key tracking: host time on
the critical path). `--cache`: state = the engine default (grammar-state keys, state_key.py), history =
token-history trie only, none = every row computed. `--check` compares every slot with a fresh llguidance
fill. `--by-state`: which rows are computed fresh (not copied), by grammar state, and their one-row cost
(a refill, so lexer tables are warm: a lower bound). `--prefetch`: the engine's order instead (each row's
fill queued by its advance; fill wall is then the wait the sampler sees, advance includes the copies made
at submit); `--no-inline-hits` queues stored masks to the worker as well (mask_slots.py); `--cold-cache`
empties the mask cache before every batch (batch 1 is then what bench_structured --cold-cache measures: a
cold mask cache over warm llguidance tables); `--verbatim-numbers` keys open numbers by their bytes (as
before number_key.py), for an A/B of the number classes.

`states`: per-row cost by grammar state, one thread, one row at a time (thread CPU time of the fill): where
in the schema the milliseconds go (inside a string by how many characters it holds, between values, ...).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_structured import SCHEMA  # noqa: E402
from bigtok import build_tokenizer_dir  # noqa: E402

VOCAB = 128256
EOS = 1


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])


def _dist(xs: list[float]) -> str:
    xs = sorted(xs) or [0.0]
    return (f"median {statistics.median(xs):.2f} p90 {xs[min(len(xs) - 1, int(0.9 * len(xs)))]:.2f} "
            f"max {xs[-1]:.2f} mean {statistics.fmean(xs):.2f}")


def steps(args: argparse.Namespace) -> None:
    from deepinfer.engine import SamplingParams
    from deepinfer.engine.structured.manager import StructuredOutputManager

    if args.verbatim_numbers:  # a plan without number classes: every open number keyed by its bytes
        from deepinfer.engine.structured import key_plan

        key_plan.number_node = lambda schema: None
    t0 = time.perf_counter()
    m = StructuredOutputManager(build_tokenizer_dir() / "tokenizer.json", VOCAB, [EOS],
                                max_threads=args.threads, steering=False, prefetch=args.prefetch,
                                mask_cache_size=0 if args.cache == "none" else 2048,
                                state_keys=args.cache == "state", inline_hits=not args.no_inline_hits)
    print(f"manager built in {time.perf_counter() - t0:.1f} s; cache={args.cache} threads={args.threads}",
          flush=True)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, json_schema=SCHEMA)
    rng = random.Random(0)
    fresh = m.allocate_bitmask(1)
    summary = []
    for batch in range(args.batches):
        if args.cold_cache:  # as bench_structured --cold-cache: llguidance's lexer tables stay warm
            m.mask_cache.clear()
        before = m.mask_stats()
        seqs = [SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=256)
                for _ in range(args.rows)]
        for s in seqs:
            m.add(s)
        wall, cpu, adv, rows = [], [], [], 0
        texts: dict[int, bytes] = {}
        by_state = ByState()
        while True:
            alive = [s for s in seqs if s.grammar is not None]
            if not alive:
                break
            fresh_rows = _fresh_rows(m, alive) if args.by_state else []
            t0, c0 = time.perf_counter(), time.process_time()
            m.masks_for(alive).wait()
            wall.append(1e3 * (time.perf_counter() - t0))
            cpu.append(1e3 * (time.process_time() - c0))
            rows += len(alive)
            view = m.slots.buffer.numpy()
            picks = []
            if args.by_state:
                by_state.record(m, alive, fresh_rows, texts, wall[-1], fresh)
            for s in alive:
                if args.check:
                    m.backend.fill_bitmasks([(0, s.grammar.matcher)], fresh)
                    assert np.array_equal(fresh[0].numpy(), view[s.grammar.slot]), "a cached mask differs"
                allowed = _allowed(view[s.grammar.slot])
                picks.append(int(allowed[rng.randrange(len(allowed))]))
            if args.by_state:
                for s, tok in zip(alive, picks):
                    texts[id(s)] = texts.get(id(s), b"") + (m._token_bytes[tok] or b"")
            t0 = time.thread_time()  # the engine thread's own CPU time: not inflated by a busy machine
            done = []
            for s, tok in zip(alive, picks):
                s.num_output_tokens += 1
                s.num_tokens += 1
                if m.advance(s, tok) or s.num_output_tokens >= args.max_tokens:
                    done.append(s)
            adv.append(1e3 * (time.thread_time() - t0))
            for s in done:
                m.free(s)
        after = m.mask_stats()
        reused = (after["mask_cache_hits"] - before["mask_cache_hits"]
                  + after["mask_cache_shared"] - before["mask_cache_shared"])
        filled = after["filled_rows"] - before["filled_rows"]
        row = {"batch": batch, "steps": len(wall), "rows_per_step": rows / max(1, len(wall)),
               "rows_by_copy": reused / max(1, filled), "fill_cpu_ms_total": sum(cpu)}
        summary.append(row)
        print(f"batch {batch} ({'cold' if batch == 0 else 'warm'}): {len(wall)} steps, "
              f"{rows / max(1, len(wall)):.0f} rows/step, rows by copy {reused / max(1, filled):.1%}, "
              f"fill CPU total {sum(cpu):.0f} ms\n  fill wall ms/step: {_dist(wall)}\n"
              f"  fill CPU ms/step:  {_dist(cpu)}\n  advance CPU ms/step (engine thread): {_dist(adv)}",
              flush=True)
        if args.by_state:
            by_state.report()
    print(json.dumps({"probe": "steps", "cache": args.cache, "threads": args.threads, "rows": args.rows,
                      "batches": summary, "masks_kept": m.mask_cache.stats()["mask_cache_masks"]}))
    m.close()


def _fresh_rows(m, alive: list) -> list[bool]:
    """Per row: will this step's fill compute it with llguidance (no stored mask for its key, not an
    earlier row of the same batch)? Mirrors MaskSlots._fill, read before the fill (prefetch is off)."""
    states, seen, out = m.mask_cache._states, set(), []
    for s in alive:
        key = s.grammar.cache_key() if m.slots.cache is not None else None
        if key is None:
            out.append(True)
            continue
        ident = key if isinstance(key, tuple) else id(key)
        stored = key in states if isinstance(key, tuple) else key.row >= 0
        out.append(not stored and ident not in seen)
        seen.add(ident)
    return out


def _where(text: bytes, lost: bool) -> str:
    """Where in bench_structured's schema a row stands: property and lexical position (finer than
    _context: numbers, enums and keys apart)."""
    if lost:
        return "no state key"
    s = text.decode("utf-8", "replace")
    inside, esc, is_key, cur, prop, last = False, False, True, "", "-", ""
    for ch in s:
        if inside:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                inside = False
                if is_key:
                    prop = cur
            else:
                cur += ch
        elif ch == '"':
            inside, cur = True, ""
            is_key = last in ("{", ",") and prop != "topics" or last == "{"
        elif ch not in " ":
            last = ch
            if ch in ",{":
                is_key = True
            if ch == "]":
                prop = prop + "]"
    if inside:
        where = "in key" if is_key else "in string"
        room = None if is_key else {"topics": 24, "summary": 200}.get(prop)
        left = "" if room is None else f" ({'<30' if room - len(cur) < 30 else '>=30'} left)"
        return f"{prop}: {where}{left}"
    if last and (last.isdigit() or last in "-.eE+"):
        return f"{prop}: in number"
    return f"{prop}: after '{last}'"


class ByState:
    """Fresh rows by grammar state and their one-row cost (thread CPU time of a fill alone), per step."""

    def __init__(self) -> None:
        self.fresh: dict[str, list[float]] = collections.defaultdict(list)
        self.copied: collections.Counter = collections.Counter()
        self.steps: list[tuple[float, float, int, int]] = []  # (fill wall ms, fresh cost ms, fresh, rows)

    def record(self, m, alive: list, fresh_rows: list[bool], texts: dict, wall_ms: float, buf) -> None:
        cost = 0.0
        for s, is_fresh in zip(alive, fresh_rows):
            label = _where(texts.get(id(s), b""), s.grammar.skey is not None and s.grammar.skey.lost)
            if not is_fresh:
                self.copied[label] += 1
                continue
            t0 = time.thread_time()
            s.grammar.matcher.fill_bitmask(buf[0])
            us = 1e6 * (time.thread_time() - t0)
            self.fresh[label].append(us)
            cost += us / 1e3
        self.steps.append((wall_ms, cost, sum(fresh_rows), len(alive)))

    def report(self) -> None:
        total = sum(sum(v) for v in self.fresh.values()) or 1.0
        n = sum(len(v) for v in self.fresh.values())
        rows = n + sum(self.copied.values())
        print(f"  fresh rows {n} of {rows} ({n / max(1, rows):.1%}), their one-row cost {total / 1e3:.0f} ms")
        for label, us in sorted(self.fresh.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {label:34s} fresh {len(us):5d} copied {self.copied[label]:5d}  share "
                  f"{sum(us) / total:6.1%}  mean {statistics.fmean(us):6.0f} us  max {max(us):6.0f} us")
        for label, c in self.copied.items():
            if label not in self.fresh:
                print(f"    {label:34s} fresh     0 copied {c:5d}")
        wall = sum(w for w, _, _, _ in self.steps)
        fresh = sum(f for _, f, _, _ in self.steps)
        print(f"  per step: fill wall {wall / len(self.steps):.2f} ms = fresh rows' one-row cost "
              f"{fresh / len(self.steps):.2f} ms + the rest (copies, grouping, hand-off) "
              f"{(wall - fresh) / len(self.steps):.2f} ms\n  fresh rows/step "
              f"{_dist([float(r) for _, _, r, _ in self.steps])}")


def _context(text: bytes) -> str:
    """A coarse grammar-state label for bench_structured's schema from the output so far."""
    s = text.decode("utf-8", "replace")
    inside, esc, cur = False, False, ""
    for ch in s:
        if inside:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                inside = False
            else:
                cur += ch
        elif ch == '"':
            inside, cur = True, ""
    keys = re.findall(r'"(label|confidence|topics|summary)": ', s)
    key = keys[-1] if keys else "-"
    if inside:
        room = {"topics": 24, "summary": 200}.get(key)
        if room is not None:
            left = room - len(cur)
            return f"{key}: in string, {left // 3 * 3}-{left // 3 * 3 + 2} chars left" if left < 30 else \
                f"{key}: in string, >= 30 chars left"
        return f"{key}: in string"
    return f"{key}: outside strings"


def states(args: argparse.Namespace) -> None:
    import llguidance
    from deepinfer.engine.structured.llguidance_backend import _JSON_OPTIONS

    tj = (build_tokenizer_dir() / "tokenizer.json").read_text()
    tok = llguidance.LLTokenizer(tj, n_vocab=VOCAB, eos_token=[EOS])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=_JSON_OPTIONS)
    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    matchers = [template.deep_copy() for _ in range(args.rows)]
    texts = [b""] * args.rows
    row = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    rng = random.Random(0)
    cost: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.max_tokens):
        live = [i for i in range(args.rows) if not matchers[i].is_stopped()]
        if not live:
            break
        for i in live:
            t0 = time.thread_time()
            matchers[i].unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            cost[_context(texts[i])].append(1e6 * (time.thread_time() - t0))
            allowed = _allowed(row)
            t = int(allowed[rng.randrange(len(allowed))])
            matchers[i].consume_token(t)
            texts[i] += tok.decode_bytes([t])
    total = sum(sum(v) for v in cost.values())
    n = sum(len(v) for v in cost.values())
    print(f"{n} rows, {total / 1e3:.0f} ms CPU, mean {total / max(1, n):.0f} us/row (one thread)")
    for label, us in sorted(cost.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:42s} rows {len(us):5d}  share {sum(us) / total:6.1%}  "
              f"mean {statistics.fmean(us):6.0f} us  max {max(us):6.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["steps", "states"])
    ap.add_argument("--rows", type=int, default=None, help="requests per batch (steps: 147, states: 40)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cache", choices=["state", "history", "none"], default="state")
    ap.add_argument("--threads", type=int, default=1, help="llguidance executor threads")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="every slot against a fresh llguidance fill")
    ap.add_argument("--by-state", action="store_true",
                    help="steps: which rows are computed fresh, by grammar state, and their one-row cost")
    ap.add_argument("--prefetch", action="store_true",
                    help="steps: the engine's order (advance queues each row's fill; fill wall = the wait)")
    ap.add_argument("--cold-cache", action="store_true",
                    help="steps: empty the mask cache before every batch (bench_structured --cold-cache)")
    ap.add_argument("--verbatim-numbers", action="store_true",
                    help="steps: keep open numbers' bytes in the state key (the keys before number_key.py)")
    ap.add_argument("--no-inline-hits", action="store_true",
                    help="steps: stored masks copied by the mask worker, not when the fill is queued")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode == "steps":
        if args.by_state and args.prefetch:
            ap.error("--by-state classifies rows before their fill: use it without --prefetch")
        args.rows = args.rows or 147
        steps(args)
    else:
        args.rows = args.rows or 40
        states(args)


if __name__ == "__main__":
    main()
