"""CUDA graphs of the model's forward for pure-decode steps, one per batch-size bucket.

(Prefill and mixed steps: runner/prefill_graphs.py, which shares the capture helpers at the end of this file.)

A decode step of a small model is host-bound: hundreds of kernel launches from Python for a few ms of GPU
work. Capturing the forward once per bucket (input_buffers.graph_buckets) and replaying it with padded
inputs (input_buffers.pad_decode) costs one launch per step. Only the forward (embedding -> layers -> final
norm) is captured; logits of the real rows and sampling run eagerly after it, since the sampler branches on
the host per step and padding rows need no logits.

Why the bits equal the eager path's: the deterministic kernels are row-independent (GEMM tiles never depend
on M, RMSNorm per row, attention per sequence), the attention plan only maps programs to sequences, and the
padding rows write no cache slot (input_buffers docstring). So a real row computes exactly what it computes
in an eager step of any size. The captured metadata's host lengths are placeholders (`graph_metadata`): the
MLA kernel of DeepSeek-V2/V3 then runs its static decode plan (kernels/split_plan.py), the same bits as
the host plan an eager step builds from the real lengths; padding tokens are routed through the MoE like any
other token, and its fixed tiles keep a token's bits independent of which tokens share its experts.
Fast mode is not batch-invariant: a graph step computes its rows as an eager step of the bucket's size
would (MLA's split policy is chosen from the bucket size), not necessarily as an eager step of the real
rows alone.

Captured at start-up, largest bucket first, all buckets sharing one memory pool (a replay's activations are
dead once its step's logits are computed, which the stream orders before the next replay); or lazily, each
bucket on the first step that needs it ($DEEPINFER_CUDA_GRAPH_CAPTURE=lazy, which the job pipeline's engines
use: a batch job of uniform parts needs few buckets, and capturing all of them costs seconds on a large
model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.runner.input_buffers import (
    DecodeStager,
    StaticDecodeBuffers,
    graph_buckets,
    graph_metadata,
    pick_bucket,
)
from deepinfer.engine.runner.step_executor import copy_pending
from deepinfer.kernels.metadata import AttentionMetadata

logger = logging.getLogger("deepinfer.engine")


def is_decode_step(out: SchedulerOutput) -> bool:
    """True when every scheduled sequence computes exactly one token (and so samples it)."""
    if out.decode is not None:   # the scheduler's decode batch (core/scheduler_decode.py)
        return True
    return bool(out.scheduled) and all(s.num_new_tokens == 1 for s in out.scheduled)


@dataclass
class GraphStats:
    """What capture cost and how often graphs ran (LLM.get_stats reports these)."""

    buckets: list[int] = field(default_factory=list)   # captured batch sizes, ascending
    split_buckets: list[int] = field(default_factory=list)   # decode buckets with a split-KV graph too
    capture_seconds: float = 0.0                       # warm-up + capture of every bucket
    memory_bytes: int = 0                              # device memory the graphs took (pool + executables)
    replays: int = 0                                   # decode steps run by a graph
    padded_rows: int = 0                               # padding rows those steps computed in all


class DecodeGraphs:
    """Captured decode forwards over fixed input buffers; `run` replays the one that fits a step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                 max_num_seqs: int, device: torch.device, max_graph_batch: int = 256,
                 split_from: int | None = None) -> None:
        self.model = model
        # The first position at which the model's paged attention splits a row's keys (None: never). A
        # step with such a row replays the bucket's split graph (split_kv metadata: the kernel's split
        # launches), captured on first use; the others replay the one-program graphs.
        self.split_from = split_from
        self._split_graphs: dict[int, tuple[torch.cuda.CUDAGraph | EagerReplay, torch.Tensor]] = {}
        self._split_step = False   # whether the step `stage` staged last has a row past split_from
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = graph_buckets(max_num_seqs, max_graph_batch)
        max_blocks = -(-max_model_len // block_size)
        self.buffers = StaticDecodeBuffers(self.buckets[-1], max_blocks, device)
        self.stager = DecodeStager(self.buckets[-1], max_blocks, block_size)   # host side, incremental
        self.stats = GraphStats()
        # bucket -> (captured graph, or a stand-in with .replay(); its static output hidden states)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | EagerReplay, torch.Tensor]] = {}
        # Lazy capture (capture_lazily): a bucket is captured the first time a step needs it.
        self.lazy = False
        self._stand_ins = False   # lazily made buckets are eager stand-ins (CPU tests)
        self._pool: object | None = None

    def _meta(self, b: int, split_kv: bool = False) -> AttentionMetadata:
        return graph_metadata(self.buffers, b, self.block_size, split_kv)

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        buf = self.buffers
        return self.model(buf.input_ids[:b], buf.positions[:b], meta, self.kv_caches)

    def _capture_one(self, b: int, pool: object, side: torch.cuda.Stream) -> None:
        meta = self._meta(b)
        self._graphs[b] = capture_graph(lambda: self._forward(b, meta), pool, self.device, side)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (Triton compiles, allocator pools) and capture every bucket, largest first.

        The buffers hold padding while capturing (slot -1: nothing is written to the cache)."""
        # Cached free blocks are released around the measurement so that the difference is the graphs' pool
        # and executables only (torch.cuda.graph empties the cache on entry anyway).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = self._pool = torch.cuda.graph_pool_handle()   # split graphs captured later share it
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            self._capture_one(b, pool, side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.stats.buckets = list(self.buckets)
        self.stats.capture_seconds = time.perf_counter() - t0
        self.stats.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d CUDA graphs (decode batch sizes %s..%s) in %.2f s, %.1f MiB",
                    len(self.buckets), self.buckets[0], self.buckets[-1], self.stats.capture_seconds,
                    self.stats.memory_bytes / 2**20)

    def capture_lazily(self, stand_ins: bool = False) -> None:
        """Capture nothing now: each bucket is captured the first time a decode step needs it (a batch job
        of uniform parts uses a few of the buckets; start-up capture of all of them costs seconds on a
        large model). `stand_ins`: make eager stand-ins instead (CPU tests of the bookkeeping).

        Why the bits are those of a start-up capture: the graph is the same kernels on the same static
        buffers. Its warm-up runs on the step's real staged inputs, so it writes the step's K/V at the
        real rows' slots; the replay that follows writes the same slots before any attention reads them,
        so nothing the warm-up wrote is ever read."""
        self.lazy, self._stand_ins = True, stand_ins

    @torch.inference_mode()
    def _capture_now(self, b: int, split_kv: bool = False) -> None:
        """Capture bucket `b` (its split graph with `split_kv`) on the staged step (module docstring)."""
        t0 = time.perf_counter()
        graphs = self._split_graphs if split_kv else self._graphs
        meta = self._meta(b, split_kv)
        if self._stand_ins:
            replay = EagerReplay(lambda: self._forward(b, meta))
            graphs[b] = (replay, replay.out)
        else:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graphs[b] = capture_measured(self.stats, lambda: self._forward(b, meta), self._pool, self.device)
        self.stats.buckets = sorted(self._graphs)
        self.stats.split_buckets = sorted(self._split_graphs)
        self.stats.capture_seconds += time.perf_counter() - t0
        logger.info("captured the CUDA graph of decode batch size %d%s on first use (%.2f s)", b,
                    " (rows with split keys)" if split_kv else "", time.perf_counter() - t0)

    @torch.inference_mode()
    def stand_in_replays(self) -> None:
        """Instead of capturing, make each bucket's "replay" run the forward eagerly into a fixed output
        tensor, as a graph writes its static output: the graph path without CUDA (CPU tests)."""
        for b in self.buckets:
            meta = self._meta(b)
            replay = EagerReplay(lambda b=b, meta=meta: self._forward(b, meta))
            self._graphs[b] = (replay, replay.out)
        self.stats.buckets = list(self.buckets)
        self._stand_ins = True   # split graphs, made on first use, are stand-ins too

    def fits(self, out: SchedulerOutput) -> bool:
        """Whether a captured graph can run this step (pure decode, no more rows than the largest bucket)."""
        return (self.lazy or bool(self._graphs)) and is_decode_step(out) and out.num_rows <= self.buckets[-1]

    def stage(self, out: SchedulerOutput, pending_rows: list[tuple[int, int]] | None,
              prev_ids: torch.Tensor | None, tokens: list[int] | None = None) -> int:
        """Copy decode step `out` into the static buffers, padded to its bucket; returns the bucket.

        pending_rows: (row, index into prev_ids) for rows whose input token is still on the device (the
        overlapped loop's placeholders), None when every row i reads prev_ids[i]; prev_ids: the previous
        step's sampled ids (device int64). tokens: each row's input token, when the caller has them."""
        d = out.decode
        if d is not None:
            seqs, starts = d.seqs, d.starts
            if tokens is None:
                tokens = [q.output_token_ids[-1] for q in seqs]   # a decode batch computes its last token
        else:
            sched = out.scheduled
            seqs, starts = [s.seq for s in sched], [s.start for s in sched]
            if tokens is None:
                tokens = [s.seq.token_at(s.start) for s in sched]
        n = len(seqs)
        b = pick_bucket(self.buckets, n)
        if b is None:
            raise ValueError(f"decode step of {n} rows exceeds the largest bucket {self.buckets[-1]}")
        # a decode row's position is its start: split counts grow with the position, so the longest decides
        self._split_step = self.split_from is not None and max(starts) >= self.split_from
        self.buffers.load(self.stager.stage(tokens, starts, [q.block_table for q in seqs], b))
        if pending_rows is None:
            assert prev_ids is not None and prev_ids.shape[0] == n
            self.buffers.input_ids[:n].copy_(prev_ids)
            return b
        if pending_rows:
            assert prev_ids is not None
            if len(pending_rows) == n == prev_ids.shape[0] and all(d == r for d, r in pending_rows):
                # Steady decoding: row i reads row i of the previous step, one device copy, no index tensors.
                self.buffers.input_ids[:n].copy_(prev_ids)
                return b
            copy_pending(self.buffers.input_ids, pending_rows, prev_ids)
        return b

    def run(self, out: SchedulerOutput, pending_rows: list[tuple[int, int]] | None,
            prev_ids: torch.Tensor | None, tokens: list[int] | None = None) -> torch.Tensor:
        """Replay the graph for decode step `out` (arguments as for `stage`); returns the final hidden
        states [n, hidden] of its rows, a view of the graph's static output."""
        b = self.stage(out, pending_rows, prev_ids, tokens)
        n = out.num_rows
        graphs = self._split_graphs if self._split_step else self._graphs
        if b not in graphs:   # lazy capture: this bucket's first step (its inputs are staged)
            self._capture_now(b, self._split_step)
        graph, hidden = graphs[b]
        graph.replay()
        self.stats.replays += 1
        self.stats.padded_rows += b - n
        return hidden[:n]

    def forward_eagerly(self, b: int, split_kv: bool = False) -> torch.Tensor:
        """The captured computation of bucket `b` (its split graph's with `split_kv`) run eagerly on the
        staged buffers (tests, CPU)."""
        return self._forward(b, self._meta(b, split_kv))


class EagerReplay:
    """A stand-in for a captured graph (CPU tests): `replay()` reruns `forward` into the fixed tensor
    `out`, as a graph writes its static output."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward = forward
        self.out = forward()

    def replay(self) -> None:
        self.out.copy_(self.forward())


def capture_graph(forward: Callable[[], torch.Tensor], pool: object, device: torch.device,
                  side: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `forward` once eagerly on a side stream (Triton compiles, allocator pools fill), then capture it
    into `pool`; returns the graph and its static output."""
    side = side if side is not None else torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()   # warm-up outside capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call from another thread (a grammar worker of another engine) must not
    # invalidate this capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out


def capture_measured(stats: GraphStats, forward: Callable[[], torch.Tensor], pool: object,
                     device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`capture_graph`, adding the device memory it took to stats.memory_bytes (cached free blocks are
    released first: torch.cuda.graph empties the cache on entry, so measure after that)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    captured = capture_graph(forward, pool, device)
    torch.cuda.synchronize(device)
    stats.memory_bytes += max(0, free_before - torch.cuda.mem_get_info(device)[0])
    return captured


def env_flag(name: str) -> bool:
    """True when environment variable `name` is set to 1/true/yes/on (case-insensitive)."""
    import os

    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def graphs_supported(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the model's decode forward is capturable on `device`: the dense decoder family and
    DeepSeek-V2/V3 (MLA + routed MoE) on CUDA, whose decode ops launch kernels only, with no host read of
    device values and no shape that depends on data (MLA takes its static decode plan; MoE routing, the
    expert sort and the grouped GEMMs' tile maps are sized from the token count alone). Exactly these
    classes: a subclass may add host work. DeepSeek-V4 (sliding window + compressed caches, whose steps
    plan on the host) and everything on CPU run eagerly."""
    from deepinfer.engine.models.decoder import CausalLM
    from deepinfer.engine.models.deepseek import DeepseekForCausalLM

    return device.type == "cuda" and type(model) in (CausalLM, DeepseekForCausalLM)


CAPTURE_ENV = "DEEPINFER_CUDA_GRAPH_CAPTURE"


def capture_mode(requested: str | None = None) -> str:
    """When decode buckets are captured: "startup" (the default: every bucket before the first step) or
    "lazy" (each bucket on its first use; the job pipeline's engines). `requested` (LLM's
    cuda_graph_capture) wins, else $DEEPINFER_CUDA_GRAPH_CAPTURE; ValueError for another value."""
    import os

    source = "cuda_graph_capture" if requested is not None else f"${CAPTURE_ENV}"
    raw = requested if requested is not None else os.environ.get(CAPTURE_ENV, "")
    mode = raw.strip().lower() or "startup"
    if mode not in ("startup", "lazy"):
        raise ValueError(f"{source}={raw!r}: expected 'startup' or 'lazy'")
    return mode


def make_decode_graphs(model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                       max_num_seqs: int, device: torch.device, enable: bool,
                       capture: str | None = None) -> DecodeGraphs | None:
    """Decode graphs when enabled, supported and not turned off by DEEPINFER_DISABLE_CUDA_GRAPHS=1, captured
    now or on first use (capture_mode(capture)); else None (steps run eagerly). CPU engines get None."""
    if not enable or env_flag("DEEPINFER_DISABLE_CUDA_GRAPHS") or not graphs_supported(model, device):
        return None
    graphs = DecodeGraphs(model, kv_caches, block_size, max_model_len, max_num_seqs, device,
                          split_from=attention_split_from(model, kv_caches))
    if capture_mode(capture) == "lazy":
        graphs.capture_lazily()
    else:
        graphs.capture()
    return graphs


def attention_tiles(model: torch.nn.Module, kv_caches: list, decode: bool) -> dict[str, int]:
    """The paged-attention kernel's tile config for this dense model and cache (kernels/paged_attention.py,
    attention_tile_config; CUDA only)."""
    from deepinfer.kernels.paged_attention import attention_tile_config

    cfg = model.config
    kv_fp8 = kv_caches[0][0].dtype == torch.float8_e4m3fn
    return attention_tile_config(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim,
                                 model.dtype, kv_fp8=kv_fp8, decode=decode)


def attention_split_from(model: torch.nn.Module, kv_caches: list) -> int | None:
    """The first position at which this model's paged attention splits a row's keys
    (kernels/paged_attention.py, attention_split_policy); None for models that do not run it (DeepSeek's
    MLA and V4 attention plan their own splits)."""
    from deepinfer.engine.models.decoder import CausalLM
    from deepinfer.kernels.paged_attention import attention_split_policy

    if type(model) is not CausalLM:
        return None
    tiles = attention_tiles(model, kv_caches, decode=True)
    return attention_split_policy(tiles).split_from(tiles["BLOCK_N"])
