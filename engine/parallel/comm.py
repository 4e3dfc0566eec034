"""The collectives a sharded model needs, over a process group private to one engine.

The group is built from its own `TCPStore` (rank 0 binds a free port the OS picks; the others are told
the port), not from `torch.distributed.init_process_group`, so nothing process-global is set and two
engines in one process do not collide. gloo serves CPU tensors, NCCL CUDA tensors.

Determinism: `reduce_sum` in deterministic mode all-gathers the ranks' partial sums and adds them locally
in rank order (in float32, rounded once), so a row's result is the same whatever the batch shape or the
collective algorithm NCCL/gloo would pick for a tensor of that size. Gathers and broadcasts move values
without arithmetic, so they are exact either way.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

LOCALHOST = "127.0.0.1"
TIMEOUT_ENV = "DEEPINFER_TP_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 600.0


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait for a peer ($DEEPINFER_TP_TIMEOUT_S, default 600 s)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(raw) if raw else _DEFAULT_TIMEOUT_S
    except ValueError as e:
        raise ValueError(f"${TIMEOUT_ENV}={raw!r}: expected a number of seconds") from e
    if seconds <= 0:
        raise ValueError(f"${TIMEOUT_ENV}={raw!r}: must be > 0")
    return datetime.timedelta(seconds=seconds)


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free localhost port (read it back from `.port` and hand it to the others)."""
    # wait_for_workers=False: the other ranks are started after the port is known.
    return dist.TCPStore(LOCALHOST, 0, world_size, True, timeout=collective_timeout(), wait_for_workers=False)


def client_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(LOCALHOST, port, world_size, False, timeout=collective_timeout())


class ParallelGroup:
    """One engine's ranks: `rank` of `world_size`, collectives on `device`'s tensors."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 deterministic: bool, prefix: str = "tp") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.deterministic = deterministic
        timeout = collective_timeout()
        scoped = dist.PrefixStore(prefix, store)
        if device.type == "cuda":
            self._pg = dist.ProcessGroupNCCL(scoped, rank, world_size, _nccl_options(timeout))
        else:
            # Bound to localhost: the ranks of one engine share a host, and nothing else is contacted.
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
            self._pg = dist.ProcessGroupGloo(scoped, rank, world_size, opts)
        # As torch's own group construction does (every rank calls it: rank 0 publishes, the others read).
        self._pg._set_sequence_number_for_group()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on every rank), in rank order."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self._pg.allgather([outs], [t]).wait()
        return outs

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `t` (a new tensor; `t` is left as it was)."""
        if self.world_size == 1:
            return t
        if self.deterministic:
            parts = self.all_gather(t)
            total = parts[0].to(torch.float32)
            for p in parts[1:]:
                total = total + p.to(torch.float32)   # rank order, whatever the batch
            return total.to(t.dtype)
        out = t.contiguous().clone()
        self._pg.allreduce([out]).wait()
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`t` filled in place with rank `src`'s values (returned for chaining)."""
        self._pg.broadcast(t, src).wait()
        return t

    def all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank r sends chunks[s] to rank s and receives what each rank sent it, in rank order.

        Chunks may differ in their first dimension (the rest of the shape and the dtype must agree); the
        sizes are exchanged first so that each rank knows what it receives."""
        if len(chunks) != self.world_size:
            raise ValueError(f"all_to_all: {len(chunks)} chunks for {self.world_size} ranks")
        rows = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64, device=self.device)
        recv_rows = torch.stack(self.all_gather(rows))[:, self.rank].tolist()   # what each rank sends me
        tail = tuple(chunks[0].shape[1:])
        send = torch.cat([c.reshape(c.shape[0], *tail) for c in chunks]).contiguous()
        recv = send.new_empty((sum(recv_rows), *tail))
        self._pg.alltoall_base(recv, send, recv_rows, rows.tolist()).wait()
        return list(recv.split(recv_rows))

    def barrier(self) -> None:
        self.reduce_sum(torch.zeros(1, device=self.device))


def _nccl_options(timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts
