"""A model-free engine loop for scheduler and finish-rule tests.

`PagedKVRunner` stands in for the model runner + sampler honestly: it writes every computed token into a
simulated paged KV cache through the sequence's block table, reads the whole context back through the
block table (so a wrong block table or a bad prefix-cache hit is caught), and "samples" a token that is a
deterministic function of the sequence's seed and the context it read. Outputs therefore depend only on
each sequence's own state, never on batch composition, chunking, preemption or cache hits.
`ScriptedRunner` samples a fixed script per sequence; `run` is the engine loop and checks the per-step
contract.
"""

from __future__ import annotations

from types import SimpleNamespace

from deepinfer.engine.core.config import CacheConfig, SchedulerConfig
from deepinfer.engine.core.finish import FinishRules
from deepinfer.engine.core.request_feed import RequestFeed
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.sequence import Sequence, SequenceStatus
from deepinfer.engine.sample.params import SamplingParams


class PagedKVRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bs], pos % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        ids, toks = [], []
        for s in out.scheduled:
            seq, end = s.seq, s.start + s.num_new_tokens
            assert len(seq.block_table) * self.bs >= end, "block table too short for the step"
            for pos in range(s.start, end):
                b, o = self.slot(seq, pos)
                self.kv[b][o] = seq.token_at(pos)
        for s in out.scheduled:   # attention reads after all writes of the step
            seq, end = s.seq, s.start + s.num_new_tokens
            context = [self.kv[b][o] for b, o in (self.slot(seq, p) for p in range(end))]
            assert context == seq.token_ids[:end], f"seq {seq.seq_id} reads a corrupted KV context"
            if s.sample:
                h = seq.seed
                for t in context:
                    h = (h * 31 + t) % 1_000_003
                ids.append(seq.seq_id)
                toks.append(h % 50 + 10)
        return ModelRunnerOutput(seq_ids=ids, token_ids=toks, logprobs=[None] * len(ids))


class ScriptedRunner:
    """Samples the next token of a per-sequence script (indexed by output position)."""

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        self.scripts = scripts

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        rows = [s.seq for s in out.sampled]
        return ModelRunnerOutput(
            seq_ids=[q.seq_id for q in rows],
            token_ids=[self.scripts[q.seq_id][q.num_output_tokens] for q in rows],
            logprobs=[{self.scripts[q.seq_id][q.num_output_tokens]: -0.5 * q.num_output_tokens}
                      for q in rows],
        )


def make_seq(seq_id: int, prompt: list[int], eos: frozenset[int] = frozenset(), **params) -> Sequence:
    params.setdefault("max_tokens", 8)
    return Sequence(seq_id=seq_id, prompt_token_ids=list(prompt), params=SamplingParams(**params),
                    seed=1000 + seq_id, eos_token_ids=eos, arrival=seq_id)


def make_scheduler(num_blocks=64, block_size=16, budget=256, max_seqs=8, max_model_len=512,
                   chunked=True, prefix=True, finish_rules: FinishRules | None = None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        enable_chunked_prefill=chunked),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
        finish_rules=finish_rules,
    )


Step = list[tuple[int, int, int, bool]]   # (seq_id, start, num_new_tokens, sample) per scheduled sequence


def run(sched: Scheduler, runner, max_steps: int = 5000,
        feed: RequestFeed | None = None) -> tuple[list[Step], list[Sequence]]:
    """The engine loop; checks the per-step contract and returns (steps, finished-in-order). `feed`: more
    requests, topped up before each schedule as EngineCore does (core/request_feed.py)."""
    cfg, bm = sched.cfg, sched.block_manager
    steps, finished = [], []
    target = SimpleNamespace(scheduler=sched, add=sched.add)   # what RequestFeed.top_up reads of a core
    while sched.has_unfinished() or (feed is not None and not feed.exhausted):
        assert len(steps) < max_steps, "no progress"
        if feed is not None:
            feed.top_up(target)
        out = sched.schedule()
        assert not out.is_empty, "unfinished sequences but an empty step"
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
        total = sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens == total <= cfg.max_num_batched_tokens
        for s in out.scheduled:
            assert s.seq.status == SequenceStatus.RUNNING and s.start == s.seq.num_computed_tokens
            assert s.num_new_tokens >= 1 and s.sample == (s.start + s.num_new_tokens == s.seq.num_tokens)
        assert sched.num_running <= cfg.max_num_seqs
        steps.append([(s.seq.seq_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled])
        finished += sched.update(out, runner.execute(out))
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every block is returned at the end"
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    return steps, finished


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 13 + 7 * i) % 97 + 1 for i in range(n)]
