"""Ranks 1..N-1 of a tensor-parallel engine: a process that builds its shard and runs the model on command.

Started by driver.py as `python -m deepinfer.engine.parallel.worker RANK FD` (a fresh interpreter: nothing
of the user's script is re-imported, unlike multiprocessing's spawn), talking to the driver over its end
of a private socket pair (`multiprocessing.connection` framing; no port, no listener). Commands arrive in
the order the driver's model calls happen; the collectives inside the model then pair up across ranks.
A worker never schedules or samples: rank 0 does, and sends each step's inputs.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch
from deepinfer.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class ShardArgs:
    """What every rank needs to build the same engine's shard (sent to each worker when it connects)."""

    model_dir: str
    dtype: torch.dtype
    device_type: str              # "cpu" or "cuda"
    device_index: int             # CUDA: rank r uses device_index + r
    deterministic: bool
    max_model_len: int | None
    allow_pickle: bool
    world_size: int

    def device_for(self, rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.device_index + rank)
        return torch.device("cpu")


def build_shard(args: ShardArgs, group):
    """Rank `group.rank`'s TensorParallelCausalLM, parameters uninitialised (then `load_shard`)."""
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.parallel.tp_model import TensorParallelCausalLM

    cfg = ModelConfig.from_dir(args.model_dir)
    ops = make_ops(group.device, args.deterministic)
    return TensorParallelCausalLM(cfg, group, ops, args.dtype, group.device, args.max_model_len).eval()


def load_shard(model, args: ShardArgs, load_format: str, seed: int) -> None:
    """A worker's weights: its slices of the checkpoint ("auto") or seeded dummy values ("dummy")."""
    from deepinfer.engine.models.loader import iter_weights

    if load_format == "dummy":
        model.init_dummy_weights(seed)
    else:
        model.load_weights(iter_weights(args.model_dir, model.group.device, allow_pickle=args.allow_pickle))


def to_wire(t: torch.Tensor | None) -> np.ndarray | None:
    """A tensor as a host array for the pipe (plain pickle: no shared-memory handles per step)."""
    return None if t is None else t.detach().cpu().numpy()


def meta_to_wire(meta: AttentionMetadata) -> dict:
    return {k: (to_wire(v) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}


def meta_from_wire(fields: dict, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(**{k: (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v)
                                for k, v in fields.items()})


@torch.inference_mode()
def serve(conn: Connection, rank: int) -> None:
    """Build the shard, then run commands until "stop" (or until the driver goes away)."""
    from deepinfer.engine.parallel.comm import ParallelGroup, client_store

    args, port = conn.recv()
    device = args.device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Each rank is a process of its own: share the host's cores instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    group = ParallelGroup(client_store(port, args.world_size), rank, args.world_size, device,
                          args.deterministic)
    model = build_shard(args, group)
    conn.send(("ready", None))
    caches: dict[int, list] = {}   # the driver names each allocated cache set
    while True:
        try:
            cmd, *payload = conn.recv()
        except EOFError:
            return   # the driver is gone
        if cmd == "stop":
            return
        if cmd == "load":
            load_shard(model, args, *payload)
            conn.send(("ok", None))
        elif cmd == "alloc":
            key, spec, num_blocks = payload
            caches[key] = model.allocate_kv_cache(spec, num_blocks, device)
            conn.send(("ok", None))
        elif cmd == "forward":
            key, ids, positions, meta = payload
            model(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device),
                  meta_from_wire(meta, device), caches[key])
        elif cmd == "logits":
            shape, = payload
            hidden = torch.empty(shape, dtype=args.dtype, device=device)
            model.compute_logits(group.broadcast(hidden, 0))
        else:
            raise RuntimeError(f"unknown tensor-parallel command {cmd!r}")


def main(argv: list[str]) -> int:
    """argv: RANK FD (this process's end of the socket pair the driver made)."""
    rank, fd = int(argv[0]), int(argv[1])
    conn = Connection(fd)
    try:
        serve(conn, rank)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
