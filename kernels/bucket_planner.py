"""Batch-invariant tile configs by M bucket, used only where the device proves them bitwise equal.

A batch-invariant GEMM may not pick its tile from M (a row's bits would then depend on the batch it came
in). It may pick it from an M *bucket* if every bucket's config computes each output element with the same
fp32 chain (same BLOCK_K, same K order, same dot options): then only which program and which MMA tile shape
computes an element differ. That this gives identical bits is a property of the GPU's MMA units, not a
language guarantee, so `BucketPlanner` proves it per (N, K, dtype, device) before using the buckets: the
first call for a shape outside CUDA-graph capture runs every bucket's config on that call's operands and
compares the outputs bitwise; if any differs, or the first call is being captured, that shape keeps one
config (`fallback`) for every M. The verdict never changes afterwards (invariance first, speed second).

Shared by the bf16 GEMM (kernels/matmul.MatmulPlanner), the rowwise FP8 GEMM
(kernels/fp8_rowwise.RowwisePlanner) and the block-scaled one (kernels/fp8_block_plan.BlockPlanner): each
passes its bucket table, its single config and its launch, and proves on `probe_rows`. torch only (no
triton), so the planner logic runs anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import torch

_log = logging.getLogger(__name__)
C = TypeVar("C")
Buckets = Sequence[tuple[int | None, C]]


def bucket_for(buckets: Buckets, m: int) -> C:
    """The config of the first bucket whose bound covers `m` (bounds ascending, the last one None)."""
    return next(cfg for max_m, cfg in buckets if max_m is None or m <= max_m)


# Rows of a proof: several 64- and 128-row tiles and a ragged last one of every bucket config, fewer than a
# prefill chunk.
PROBE_ROWS = 300


def probe_rows(k: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Fixed random activation rows [PROBE_ROWS, k] (seed 0, float32 normals times `scale`, then `dtype`):
    what a planner's proof multiplies. Not the first call's own rows, which can be degenerate (a CUDA-graph
    warm-up runs on zeroed buffers)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(PROBE_ROWS, k, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # The raw bytes: -0.0 differs from 0.0, and equal NaNs compare equal (torch.equal says NaN != NaN).
    return t.contiguous().view(torch.uint8) if t.is_floating_point() and t.dim() else t


def outputs_agree(run: Callable[[C], torch.Tensor], configs: Sequence[C]) -> bool:
    """Whether `run(cfg)` gives bitwise identical outputs (same shape, same bytes) for every config. A config
    that fails to run (e.g. a tile needing more shared memory than the device has) counts as disagreeing,
    with a warning: the planner then keeps its single config rather than failing the engine."""
    outs = []
    for cfg in configs:
        try:
            outs.append(_bits(run(cfg)))
        except Exception as e:  # noqa: BLE001 - any launch failure: fall back to the single config
            _log.warning("M-bucket config %s failed to run (%s: %s); keeping one config for every M",
                         cfg, type(e).__name__, str(e)[:200])
            return False
    return all(torch.equal(outs[0], o) for o in outs[1:])


class BucketPlanner(Generic[C]):
    """Chooses a GEMM's config by M bucket for weight shapes whose bucket configs agree bitwise.

    `buckets(n, k, dtype)`: (max_m, config) pairs by ascending M, the last open-ended (a function of the
    weight only); `fallback(n, k, dtype)`: the single config used for every M where the buckets are not
    proven; `launch(*operands, config)`: the GEMM with a given config, run by the proof. One planner per
    engine (the ops backend owns it); verdicts are never shared between engines or devices. `prove_single`:
    prove a one-bucket table too (see `__init__`).
    """

    def __init__(self, buckets: Callable[[int, int, torch.dtype], Buckets],
                 fallback: Callable[[int, int, torch.dtype], C],
                 launch: Callable[..., torch.Tensor], prove_single: bool = False) -> None:
        self._buckets = buckets
        # A one-bucket table is used unproven unless `prove_single` (a planner whose proof also compares
        # the fallback config, so even one bucket config must show the fallback's bits first).
        self._prove_single = prove_single
        self._fallback = fallback
        self._launch = launch
        self._verdicts: dict[tuple[int, int, torch.dtype, str, Hashable], bool] = {}

    def choose(self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
               *operands: object, key_extra: Hashable = None) -> C:
        """The config for an [m, k] x [n, k]^T call on `device`; `operands` are what `launch` takes before
        the config (used once per shape, by the proof); `key_extra`: whatever else the verdict depends on
        (kept apart per value, e.g. a launch option the proof exercises)."""
        buckets = self._buckets(n, k, dtype)
        if len(buckets) == 1 and not self._prove_single:
            return buckets[0][1]
        key = (n, k, dtype, str(device), key_extra)
        agree = self._verdicts.get(key)
        if agree is None:
            capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
            agree = False if capturing else bool(self._agree(*operands, buckets))
            self._verdicts[key] = agree
        if not agree:
            return self._fallback(n, k, dtype)
        return bucket_for(buckets, m)

    def _agree(self, *args: object) -> bool:
        """The proof: (*operands, buckets) -> every bucket's config gives the same bits on the operands.
        Subclasses may widen the set of configs compared (e.g. a loader variant of each)."""
        *operands, buckets = args
        return outputs_agree(lambda cfg: self._launch(*operands, cfg), [cfg for _, cfg in buckets])

    def verdicts(self) -> dict[str, bool]:
        """Per weight shape 'NxK dtype device': whether the M-bucket configs are in use (diagnostics)."""
        return {f"{n}x{k} {str(d).removeprefix('torch.')} {dev}{'' if extra is None else f' {extra}'}": v
                for (n, k, d, dev, extra), v in self._verdicts.items()}
