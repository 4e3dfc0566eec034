"""Rank 0 of a tensor-parallel engine, in the user's process: the model object `LLM` runs.

`start_tensor_parallel` starts ranks 1..N-1 (worker.py, one process each), builds rank 0's shard beside
them and returns a `TensorParallelDriver`, which has the interface the engine calls on a model
(`load_weights` / `init_dummy_weights`, `forward`, `compute_logits`, `kv_cache_spec`, `allocate_kv_cache`,
`max_positions`); each call is mirrored on every rank. Only rank 0 schedules and
samples: each call is sent to the workers first (the step's token ids, positions and attention metadata;
for the LM head the hidden rows, broadcast through the group), then run on rank 0's shard, and the
collectives inside pair the ranks up. Logits are gathered whole on rank 0, so the sampler, the
structured-output masks and logprobs are exactly the single-device ones.

Limits: CUDA-graph capture is off under tensor parallelism (each step runs eagerly), and every step's
inputs cross to the workers through the host.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection

import torch
from deepinfer.engine.parallel.comm import ParallelGroup, collective_timeout, master_store
from deepinfer.engine.parallel.worker import ShardArgs, build_shard, meta_to_wire, to_wire
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection) -> None:
        self.rank, self.proc, self.conn = rank, proc, conn

    def failure(self) -> str:
        """The worker's reported traceback, or how its process ended."""
        try:
            while self.conn.poll(0):
                kind, detail = self.conn.recv()
                if kind == "error":
                    return detail
        except (EOFError, OSError):
            pass
        code = self.proc.poll()
        return f"process exited with code {code}" if code is not None else "no report (still running)"


def _spawn(rank: int) -> _Worker:
    parent, child = socket.socketpair()
    # The same interpreter and environment as this process, so the worker imports the same deepinfer.
    # A session of its own: Ctrl-C in a terminal interrupts rank 0, which then stops the workers itself
    # (a worker whose driver is gone exits when its socket closes).
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.parallel.worker", str(rank),
                             str(child.fileno())], pass_fds=[child.fileno()], start_new_session=True)
    child.close()
    return _Worker(rank, proc, Connection(parent.detach()))


def _stop(workers: list[_Worker]) -> None:
    """Ask every worker to stop; kill those that do not within a few seconds."""
    for w in workers:
        try:
            w.conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + 10
    for w in workers:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.conn.close()


def _first_tensor(caches: list) -> torch.Tensor | None:
    if not caches:
        return None
    layer = caches[0]
    return layer[0] if isinstance(layer, (tuple, list)) else layer


class TensorParallelDriver(nn.Module):
    """Rank 0's shard plus the workers; call `shutdown()` (or drop it) to stop them."""

    def __init__(self, args: ShardArgs) -> None:
        super().__init__()
        world = args.world_size
        self.args = args
        self._store = master_store(world)   # kept alive: NCCL reads its rendezvous lazily
        self._caches: list[list] = []
        self._broken = ""   # why the engine stopped (a failed step), or "" while it works
        self._workers = [_spawn(r) for r in range(1, world)]
        self._stopper = weakref.finalize(self, _stop, self._workers)
        try:
            for w in self._workers:
                w.conn.send((args, self._store.port))
            group = ParallelGroup(self._store, 0, world, args.device_for(0), args.deterministic)
            self.local = build_shard(args, group)
            self._expect("ready")
        except BaseException:
            self.shutdown()
            raise

    # ---- the model interface the engine calls ----------------------------------------------------
    @property
    def config(self):
        return self.local.config

    @property
    def max_positions(self) -> int:
        return self.local.max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list) -> torch.Tensor:
        key = self._cache_key(kv_caches)
        self._send(("forward", key, to_wire(input_ids), to_wire(positions), meta_to_wire(meta)))
        return self._guard(lambda: self.local(input_ids, positions, meta, kv_caches))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.args.dtype).contiguous()
        self._send(("logits", tuple(hidden.shape)))

        def run() -> torch.Tensor:
            self.local.group.broadcast(hidden, 0)
            return self.local.compute_logits(hidden)

        return self._guard(run)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 keeps its slices of `weights`; every worker reads its own from the checkpoint directory."""
        self._send(("load", "auto", 0))
        self._guard(lambda: self.local.load_weights(weights))
        self._expect("ok")

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Seeded random weights on every rank (see TensorParallelCausalLM.init_dummy_weights)."""
        self._send(("load", "dummy", seed))
        self.local.init_dummy_weights(seed)
        self._expect("ok")

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype):
        return self.local.kv_cache_spec(block_size, dtype)

    def allocate_kv_cache(self, spec, num_blocks: int, device: torch.device | str) -> list:
        """Every rank allocates `num_blocks` blocks of its own layout; rank 0's caches are returned."""
        key = len(self._caches)
        self._send(("alloc", key, spec, num_blocks))
        caches = self.local.allocate_kv_cache(spec, num_blocks, device)
        self._expect("ok")
        self._caches.append(caches)   # held: a cache set is named by its position here
        return caches

    def shutdown(self) -> None:
        """Stop the worker processes (idempotent; also runs when the driver is garbage-collected)."""
        self._stopper()

    # ---- plumbing --------------------------------------------------------------------------------
    def _cache_key(self, kv_caches: list) -> int:
        """Which allocated cache set `kv_caches` is (the workers hold theirs under the same key)."""
        first = _first_tensor(kv_caches)
        for key, caches in enumerate(self._caches):
            if _first_tensor(caches) is first:   # the same storage, whatever list now holds it
                return key
        raise ValueError("kv_caches were not allocated by this driver's allocate_kv_cache")

    def _send(self, msg: tuple) -> None:
        if self._broken:
            raise RuntimeError(f"this tensor-parallel engine stopped after a failed step ({self._broken}); "
                               "build a new LLM")
        for w in self._workers:
            try:
                w.conn.send(msg)
            except OSError as e:
                raise RuntimeError(f"tensor-parallel rank {w.rank} is gone: {w.failure()}") from e

    def _guard(self, run):
        """Run a collective step; when it fails, name the worker that broke it.

        A step that did not finish on rank 0 (an error, or Ctrl-C) leaves the ranks out of step with each
        other, so the workers are stopped and the engine refuses further calls instead of mismatching
        collectives."""
        try:
            return run()
        except BaseException as e:
            reports = [f"rank {w.rank}: {w.failure()}" for w in self._workers if w.proc.poll() is not None
                       or w.conn.poll(0)]
            self._broken = f"{type(e).__name__}: {e}"[:200]
            self.shutdown()
            if reports:
                raise RuntimeError("tensor-parallel step failed; " + "; ".join(reports)) from e
            raise

    def _expect(self, kind: str) -> None:
        """Wait for every worker's `kind` reply (bounded by the collective timeout)."""
        deadline = time.monotonic() + collective_timeout().total_seconds()
        for w in self._workers:
            while not w.conn.poll(0.2):
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {w.rank} did not answer {kind!r}: "
                                       f"{w.failure()}")
            try:
                got, detail = w.conn.recv()
            except EOFError as e:
                raise RuntimeError(f"tensor-parallel rank {w.rank} is gone: {w.failure()}") from e
            if got != kind:
                raise RuntimeError(f"tensor-parallel rank {w.rank} failed:\n{detail}")


def start_tensor_parallel(args: ShardArgs) -> TensorParallelDriver:
    """Start an engine's `args.world_size` ranks and return rank 0's model (load its weights next)."""
    if args.world_size < 2:
        raise ValueError(f"tensor_parallel_size={args.world_size}: the driver needs at least 2 ranks")
    if args.device_type == "cuda":
        need = args.device_index + args.world_size
        if torch.cuda.device_count() < need:
            raise ValueError(f"tensor_parallel_size={args.world_size} from cuda:{args.device_index} needs "
                             f"{need} GPUs; this machine has {torch.cuda.device_count()}")
    return TensorParallelDriver(args)
