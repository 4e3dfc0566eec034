"""CUDA graphs of the model's forward for prefill and mixed steps, one per token bucket, captured lazily.

On by default for the dense decoders on CUDA ($DEEPINFER_DISABLE_PREFILL_GRAPHS=1 turns them off). The
bits are argued (runner/prefill_inputs.py) and tested on CPU through stand-in replays and under Triton's
interpreter, and on the H200 (tokens and logprobs equal with and without them). What they buy is a prefill
step whose time no longer depends on how fast the host launches ~250 kernels: on a shared host whose speed
drifts, the 0.5B shape's prefill steps took 28-48 ms eagerly and 28-30 ms as graphs (benchmarks/RESULTS.md,
2026-12-03 16:05). They cost device memory (one activation set per captured bucket: 0.6-1.0 GB on the 0.5B
shape, 2.2-3.3 GB on the 8B, at 16k-token steps) and a capture per bucket on its first use.

A step fits when it is not a decode step (those take the decode graphs), its tokens fit the largest bucket
and no request in it wants prompt logprobs (those need every position's hidden state). A step with a row
past paged attention's split threshold replays its bucket's split graph, whose programs reduce and merge
their rows' key ranges themselves, where the prefill tile does that (MERGE_IN_PLACE: the plain four-warp
tiles of a 16-bit cache with heads below 128, and float32); on the DOT_SUM tiles (e4m3 caches, 128-dim
heads) its split programs are planned from the rows' lengths, which a graph cannot replay, so such a step
runs eagerly ($DEEPINFER_EAGER_SPLIT_PREFILL=1: always, for A/B).

Each bucket is captured the first time a step needs it, on that step's staged inputs: the warm-up writes
the step's K/V at its own slots and the replay that follows writes the same values there before attention
reads them (as in the decode graphs' lazy capture, runner/cuda_graphs.py). If a capture fails, prefill
graphs are switched off for the engine with a warning and the step runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch
from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.runner.cuda_graphs import (
    EagerReplay,
    GraphStats,
    attention_split_from,
    attention_tiles,
    capture_measured,
    env_flag,
    graphs_supported,
    is_decode_step,
)
from deepinfer.engine.runner.host_step import flatten_step
from deepinfer.engine.runner.input_buffers import pick_bucket
from deepinfer.engine.runner.prefill_inputs import (
    StaticPrefillBuffers,
    pad_prefill,
    prefill_buckets,
    prefill_graph_metadata,
)
from deepinfer.engine.runner.step_executor import copy_pending
from deepinfer.engine.sample.metadata import index_tensor

logger = logging.getLogger("deepinfer.engine")

DISABLE_PREFILL_GRAPHS_ENV = "DEEPINFER_DISABLE_PREFILL_GRAPHS"
EAGER_SPLIT_ENV = "DEEPINFER_EAGER_SPLIT_PREFILL"


class PrefillGraphs:
    """Captured prefill forwards over static buffers; `run` replays the one whose bucket fits a step.

    block_q: the attention kernel's query rows per program for prefill tiles (its static plan is built for
    it); None where no Triton kernel runs (CPU stand-ins). stand_ins: each bucket's "graph" reruns the
    forward eagerly into a fixed tensor (the graph path without CUDA, for CPU tests)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, device: torch.device, block_q: int | None,
                 first_bucket: int = 256, bucket_step: int = 2048, stand_ins: bool = False,
                 split_from: int | None = None, split_graphs: bool = False) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.split_from = split_from   # runner/cuda_graphs.attention_split_from
        self.split_graphs = split_graphs   # whether steps with split rows take graphs (module docstring)
        self.buckets = prefill_buckets(max_num_batched_tokens, first_bucket, bucket_step)
        self.max_seqs = max_num_seqs
        self.block_q = block_q
        self.buffers = StaticPrefillBuffers(self.buckets[-1], max_num_seqs, -(-max_model_len // block_size),
                                            block_q, device)
        self.stand_ins = stand_ins
        self.stats = GraphStats()
        self.failed = False
        # (bucket, split rows) -> the graph and its output
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | EagerReplay, torch.Tensor]] = {}
        self._pool: object | None = None

    def _has_split_rows(self, out: SchedulerOutput) -> bool:
        """Whether a row of the step reaches a position at or past `split_from`."""
        return self.split_from is not None and any(s.start + s.num_new_tokens > self.split_from
                                                   for s in out.scheduled)

    def fits(self, out: SchedulerOutput) -> bool:
        """Whether a bucket can run this step (module docstring; prompt logprobs are the caller's test)."""
        sched = out.scheduled
        if not self.split_graphs and self._has_split_rows(out):
            return False
        return (not self.failed and bool(sched) and len(sched) <= self.max_seqs and not is_decode_step(out)
                and sum(s.num_new_tokens for s in sched) <= self.buckets[-1])

    def _forward(self, bucket: int, split: bool) -> torch.Tensor:
        buf = self.buffers
        meta = prefill_graph_metadata(buf, bucket, self.block_size, live=self.stand_ins, split_kv=split)
        return self.model(buf.input_ids[:bucket], buf.positions[:bucket], meta, self.kv_caches)

    def _capture(self, key: tuple[int, bool]) -> bool:
        """Capture graph `key` (bucket, split rows) on the staged step; False (prefill graphs off) when
        capturing fails."""
        t0 = time.perf_counter()
        try:
            if self.stand_ins:
                replay = EagerReplay(lambda: self._forward(*key))
                self._graphs[key] = (replay, replay.out)
            else:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                self._graphs[key] = capture_measured(self.stats, lambda: self._forward(*key), self._pool,
                                                     self.device)
        except RuntimeError as e:   # an op that cannot be captured: run every prefill step eagerly
            self.failed = True
            logger.warning("prefill CUDA graphs switched off: capturing %d tokens failed (%s)", key[0], e)
            return False
        self.stats.buckets = sorted(b for b, split in self._graphs if not split)
        self.stats.split_buckets = sorted(b for b, split in self._graphs if split)
        self.stats.capture_seconds += time.perf_counter() - t0
        logger.info("captured the CUDA graph of prefill bucket %d tokens%s on first use (%.2f s)", key[0],
                    " (rows with split keys)" if key[1] else "", time.perf_counter() - t0)
        return True

    def run(self, out: SchedulerOutput, pending: list[tuple[int, int]],
            prev_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Replay the graph for step `out`; returns the final hidden states of its sampling rows [S, hidden]
        (a new tensor), or None when the step cannot take a graph (run it eagerly).

        pending: (flat token index, row in prev_ids) of inputs still on the device (step_executor's
        pending_inputs); prev_ids: the previous step's sampled ids (device int64)."""
        step = flatten_step(out, self.block_size)
        bucket = pick_bucket(self.buckets, step.num_tokens)
        assert bucket is not None, "fits() was not asked"
        if step.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None   # a table past max_model_len's blocks (never expected): the eager step takes it
        self.buffers.load(pad_prefill(step, bucket, self.max_seqs, self.block_q))
        if pending:
            assert prev_ids is not None
            copy_pending(self.buffers.input_ids, pending, prev_ids)
        key = (bucket, self._has_split_rows(out))
        if key not in self._graphs and not self._capture(key):
            return None
        graph, hidden = self._graphs[key]
        graph.replay()
        self.stats.replays += 1
        self.stats.padded_rows += bucket - step.num_tokens
        return hidden.index_select(0, index_tensor(step.sample_rows, self.device))


def make_prefill_graphs(model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                        max_num_seqs: int, max_num_batched_tokens: int, device: torch.device,
                        enable: bool) -> PrefillGraphs | None:
    """Prefill graphs when enabled, not switched off ($DEEPINFER_DISABLE_PREFILL_GRAPHS=1) and supported:
    the dense decoder family on CUDA (DeepSeek's MLA plans its prefill on the host); else None. Steps with
    split rows take graphs where the prefill tile merges in place (module docstring)."""
    from deepinfer.engine.models.decoder import CausalLM

    if not enable or env_flag(DISABLE_PREFILL_GRAPHS_ENV) or env_flag("DEEPINFER_DISABLE_CUDA_GRAPHS"):
        return None
    if not graphs_supported(model, device) or type(model) is not CausalLM:
        return None
    tiles = attention_tiles(model, kv_caches, decode=False)
    return PrefillGraphs(model, kv_caches, block_size, max_model_len, max_num_seqs, max_num_batched_tokens,
                         device, tiles["BLOCK_Q"], split_from=attention_split_from(model, kv_caches),
                         split_graphs=bool(tiles.get("MERGE_IN_PLACE", 0)) and not env_flag(EAGER_SPLIT_ENV))
