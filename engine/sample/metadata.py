"""Per-row sampling parameters of one step, as tensors on the logits' device.

Everything the sampler branches on (which rows are greedy, which need top-k/top-p/min-p/penalties/
min_tokens/logprobs) is decided here on the host from the SamplingParams, so the sampler never syncs with
the device to choose a path. Row subsets are index tensors: a filter runs only on the rows that need it,
and because every filter is a per-row computation that is exact or an identity for neutral parameters,
which other rows are present never changes a row's result.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace
from itertools import repeat

import numpy as np
import torch
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.sample.penalty_tokens import (
    PenaltyTokens,
    pack_entries,
    penalised_prompt,
    sequence_entries,
)
from deepinfer.engine.sample.rng import to_int64
from deepinfer.kernels.reference.sampling import pack_filter_params, pack_row_params


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: on CUDA through pinned staging memory and a
    non-blocking copy (a plain .to() from pageable memory waits for all queued device work, which would stall
    the overlapped loop behind the forward in flight)."""
    if device.type != "cuda" or t.numel() == 0:   # an empty copy moves nothing and waits for nothing
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PenaltyData:
    """Penalty inputs for the rows in `rows` (indices into the batch), as sparse entries: one per distinct
    token a row has seen (engine/sample/penalty_tokens.py; kernels/reference/penalties.py applies them)."""

    rows: torch.Tensor                    # int64 [P]
    params: torch.Tensor                  # float32 [3, P]: repetition, presence, frequency of rows[j]
    entries: torch.Tensor                 # int32 [3, E]: (j, token id, output count), tokens distinct per j


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row tensors for `Sampler`. Build with `from_sequences` (engine) or `from_params` (tests, tools)."""

    num_rows: int
    vocab_size: int
    device: torch.device
    penalties: PenaltyData | None
    # min_tokens: (row, token) pairs to set to -inf this step (EOS and stop ids before min_tokens outputs).
    blocked_rows: torch.Tensor | None     # int64 [B]
    blocked_tokens: torch.Tensor | None   # int64 [B]
    num_logprobs: list[int | None]        # per row: params.logprobs
    # The torch path's draw fields. Metadata built for the kernels leaves them None (the kernels read
    # row_params / filter_params only, so a kernel step moves none of them to the device) until
    # `with_draw_fields()` builds them from `draw_source`.
    greedy_rows: torch.Tensor | None = None     # int64 [G]: rows sampled by argmax (temperature 0)
    sample_rows: torch.Tensor | None = None     # int64 [R]: rows sampled at random, in batch order
    # The following are indexed like sample_rows (length R).
    temperature: torch.Tensor | None = None     # float32 [R]
    seeds: torch.Tensor | None = None           # int64 [R] (seed mod 2**64 as a signed bit pattern)
    positions: torch.Tensor | None = None       # int64 [R]: output position being sampled
    top_k: torch.Tensor | None = None           # int64 [R]: vocab_size when disabled
    top_p: torch.Tensor | None = None           # float64 [R]
    min_p: torch.Tensor | None = None           # float32 [R]
    top_p_idx: torch.Tensor | None = None       # int64: positions within sample_rows that use top-p
    top_k_only_idx: torch.Tensor | None = None  # int64: positions within sample_rows with top-k, no top-p
    top_k_only_max: int = 0                     # the largest k among top_k_only_idx rows (0 when none)
    min_p_idx: torch.Tensor | None = None       # int64: positions within sample_rows that use min-p
    # For the sampling kernels, built when `for_kernel`: row_params (kernels/sampling.py), int64 [3, S] of
    # (seed, position, float32 bits of T) per row, T = 0 for greedy rows and -1 (skip) for rows that use
    # top-k/top-p/min-p; filter_params (kernels/sampling_filter.py), int64 [7, F] describing those rows
    # (pack_filter_params), None if there are none.
    row_params: torch.Tensor | None = None
    filter_params: torch.Tensor | None = None
    # (params, seeds, positions, sampled rows) the draw fields are built from when they are None.
    draw_source: tuple | None = field(default=None, repr=False, compare=False)

    def with_draw_fields(self) -> SamplingMetadata:
        """This metadata with the torch path's draw fields (built now if it was made for the kernels)."""
        if self.sample_rows is not None or self.draw_source is None:
            return self
        params, seeds, positions, sample = self.draw_source
        return replace(self, **_draw_fields(params, seeds, positions, sample, self.num_rows, self.vocab_size,
                                            self.device), draw_source=None)

    @property
    def all_greedy(self) -> bool:
        if self.sample_rows is None and self.draw_source is not None:
            return not self.draw_source[3]
        return self.sample_rows is not None and self.sample_rows.numel() == 0

    @property
    def needs_logprobs(self) -> bool:
        return any(n is not None for n in self.num_logprobs)

    @classmethod
    def from_sequences(
        cls, seqs: list[Sequence], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        """Metadata for sampling the next token of each sequence (row i = seqs[i]).

        The draw position is `seq.num_output_tokens`; the seed is `seq.seed`. Token ids for penalties are
        read only when some row uses a penalty; EOS ids (unless ignore_eos) and stop_token_ids are blocked
        while a row has fewer than min_tokens outputs.
        """
        params = [s.params for s in seqs]
        distinct = _distinct(params)
        # Token ids are gathered only when a row reads them (penalties; EOS ids for min_tokens): without
        # them the defaults (empty) give the same metadata, at no per-row cost.
        tokens = any(_uses_penalty(p) for p in distinct)
        eos = any(p.min_tokens > 0 for p in distinct)
        device = torch.device(device)
        if len(distinct) == 1 and distinct[0].greedy and not eos and device.type != "cuda":
            # Every row greedy, off the kernel path: seeds and positions are never read (no draw, no
            # min_tokens blocking), so the per-row gathers are skipped.
            seeds = positions = [0] * len(seqs)
        else:
            seeds, positions = [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs]
        return cls.from_params(
            params,
            seeds=seeds,
            positions=positions,
            vocab_size=vocab_size,
            device=device,
            eos_token_ids=[s.eos_token_ids for s in seqs] if eos else None,
            penalty_entries=(lambda i: sequence_entries(seqs[i], vocab_size)) if tokens else None,
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: SequenceABC[int],
        positions: SequenceABC[int],
        vocab_size: int,
        device: torch.device | str,
        prompt_token_ids: SequenceABC[SequenceABC[int]] | None = None,
        output_token_ids: SequenceABC[SequenceABC[int]] | None = None,
        eos_token_ids: SequenceABC[SequenceABC[int]] | None = None,
        for_kernel: bool | None = None,
        penalty_entries: Callable[[int], np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """Metadata from explicit per-row values. Token-id lists default to empty when not given.

        `for_kernel` (default: on CUDA devices) also builds `row_params`/`filter_params` for the sampling
        kernels. `penalty_entries(i)` replaces the prompt and output lists for penalties: row i's int32
        [2, n] (token id, output count) entries, from a table kept on its sequence (`sequence_entries`)."""
        n = len(params)
        if len(seeds) != n or len(positions) != n:
            raise ValueError(
                f"SamplingMetadata: got {n} params, {len(seeds)} seeds, {len(positions)} positions"
            )
        if vocab_size < 1:
            raise ValueError(f"SamplingMetadata: vocab_size={vocab_size} must be >= 1")
        device = torch.device(device)
        empty: list[tuple[int, ...]] = [()] * n   # read only: one shared empty row
        prompts = empty if prompt_token_ids is None else prompt_token_ids
        outputs = empty if output_token_ids is None else output_token_ids
        eos = empty if eos_token_ids is None else eos_token_ids

        # One SamplingParams for every row (LLM.generate with one params object): its flags are read once.
        p0 = params[0] if len(_distinct(params)) == 1 else None
        if p0 is not None:
            sample = [] if p0.greedy else list(range(n))
        else:
            sample = [i for i, p in enumerate(params) if not p.greedy]
        if for_kernel is None:
            for_kernel = device.type == "cuda"
        row_params = filter_params = None
        if for_kernel:
            temps: list[float] | float
            if p0 is not None:
                filt = sample if _uses_filter(p0, vocab_size) else []
                temps = -1.0 if filt else float(p0.temperature)
            else:
                filt = [i for i in sample if _uses_filter(params[i], vocab_size)]
                skip = set(filt)
                temps = [-1.0 if i in skip else float(params[i].temperature) for i in range(n)]
            host_rows = pack_row_params(temps, _int64_seeds(seeds), [int(x) for x in positions])
            row_params = to_device(host_rows, device)
            if filt:
                filter_params = to_device(_filter_fields(params, p0, filt, host_rows, vocab_size), device)
        # For the kernels the draw fields wait for `with_draw_fields` (copies of the lists: the caller's may
        # change before the torch path, if it ever runs, reads them).
        draw = ({"draw_source": (list(params), list(seeds), list(positions), sample)} if for_kernel else
                _draw_fields(params, seeds, positions, sample, n, vocab_size, device))
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            **draw,
            penalties=None if p0 is not None and not _uses_penalty(p0) else _penalty_data(
                params, penalty_entries or _list_entries(params, prompts, outputs, vocab_size), device),
            # min_tokens = 0 blocks nothing (positions are >= 0).
            **(_blocked(params, eos, positions, vocab_size, device) if p0 is None or p0.min_tokens > 0
               else {"blocked_rows": None, "blocked_tokens": None}),
            num_logprobs=[p0.logprobs] * n if p0 is not None else [p.logprobs for p in params],
            row_params=row_params,
            filter_params=filter_params,
        )


def index_tensor(values: SequenceABC[int], device: torch.device) -> torch.Tensor:
    """int64 row indices (or other host ints) on `device`, without blocking the host (`to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def _distinct(params: list[SamplingParams]) -> list[SamplingParams]:
    """`params` itself, or [params[0]] when every row holds that same object (checked by identity)."""
    if params and all(map(operator.is_, params, repeat(params[0]))):
        return params[:1]
    return params


def _int64_seeds(seeds: SequenceABC[int]) -> list[int]:
    """[to_int64(s) for s in seeds]: the seeds themselves when all are already in the int64 range (the
    common case; to_int64 is then the identity), so only out-of-range seeds cost a Python call each."""
    if seeds and isinstance(seeds, list) and -(1 << 63) <= min(seeds) and max(seeds) < 1 << 63:
        return seeds
    return [to_int64(x) for x in seeds]


def _uses_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _uses_filter(p: SamplingParams, vocab_size: int) -> bool:
    """True when a sampled row narrows its distribution (top-k, top-p or min-p)."""
    return _top_k(p, vocab_size) < vocab_size or p.top_p < 1.0 or p.min_p > 0.0


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    """The k a row's draw keeps: vocab_size when top-k is off (-1) or no narrower than the vocabulary."""
    return vocab_size if p.top_k == -1 or p.top_k >= vocab_size else p.top_k


def _filter_fields(params: list[SamplingParams], p0: SamplingParams | None, filt: list[int],
                   host_rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """pack_filter_params of the rows `filt` (host tensor), seeds and positions taken from the packed
    row_params `host_rows`; one SamplingParams for all (p0) is read once."""
    rows = [p0] if p0 is not None else [params[i] for i in filt]
    top_k = [_top_k(p, vocab_size) for p in rows]
    zeros = [0] * len(rows)
    out = pack_filter_params(zeros, [float(p.temperature) for p in rows], zeros, zeros, top_k,
                             [float(p.top_p) for p in rows], [float(p.min_p) for p in rows])
    if p0 is not None:
        out = out.expand(-1, len(filt)).clone()
    every = len(filt) == host_rows.shape[1]   # then filt is every row, in order
    idx = torch.arange(len(filt)) if every else torch.tensor(filt, dtype=torch.int64)
    out[0] = idx
    out[1:3] = host_rows[:2].index_select(1, idx)
    return out


def _draw_fields(
    params: list[SamplingParams], seeds: SequenceABC[int], positions: SequenceABC[int], sample: list[int],
    n: int, vocab_size: int, device: torch.device,
) -> dict[str, object]:
    """The draw fields of SamplingMetadata: greedy_rows, and those indexed like sample_rows for the batch
    rows `sample` (the other rows of the n are greedy)."""
    if not sample:   # an all-greedy batch: the row indices made on the device (no host -> device copy)
        i64, f32 = (torch.empty(0, dtype=t, device=device) for t in (torch.int64, torch.float32))
        return {"greedy_rows": torch.arange(n, dtype=torch.int64, device=device), "sample_rows": i64,
                "temperature": f32, "seeds": i64, "positions": i64, "top_k": i64,
                "top_p": torch.empty(0, dtype=torch.float64, device=device), "min_p": f32, "top_p_idx": None,
                "top_k_only_idx": None, "top_k_only_max": 0, "min_p_idx": None}
    chosen = set(sample) if len(sample) < n else None
    greedy = [] if chosen is None else [i for i in range(n) if i not in chosen]

    def f32_on(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)

    def sub_idx(values: list[int]) -> torch.Tensor | None:
        return index_tensor(values, device) if values else None

    sp = [params[i] for i in sample]
    top_k = [_top_k(p, vocab_size) for p in sp]
    use_top_p = [j for j, p in enumerate(sp) if p.top_p < 1.0]
    top_p_set = set(use_top_p)
    top_k_only = [j for j, k in enumerate(top_k) if k < vocab_size and j not in top_p_set]
    return {
        "greedy_rows": index_tensor(greedy, device),
        "sample_rows": index_tensor(sample, device),
        "temperature": f32_on([float(p.temperature) for p in sp]),
        "seeds": index_tensor([to_int64(seeds[i]) for i in sample], device),
        "positions": index_tensor([int(positions[i]) for i in sample], device),
        "top_k": index_tensor(top_k, device),
        "top_p": to_device(torch.tensor([float(p.top_p) for p in sp], dtype=torch.float64), device),
        "min_p": f32_on([float(p.min_p) for p in sp]),
        "top_p_idx": sub_idx(use_top_p),
        "top_k_only_idx": sub_idx(top_k_only),
        "top_k_only_max": max((top_k[j] for j in top_k_only), default=0),
        "min_p_idx": sub_idx([j for j, p in enumerate(sp) if p.min_p > 0.0]),
    }


def _list_entries(params: list[SamplingParams], prompts: SequenceABC[SequenceABC[int]],
                  outputs: SequenceABC[SequenceABC[int]], vocab_size: int) -> Callable[[int], np.ndarray]:
    """Row i's penalty entries from its token lists (a table built for the one call)."""

    def entries(i: int) -> np.ndarray:
        return PenaltyTokens(penalised_prompt(params[i], prompts[i]), vocab_size).sync(outputs[i]).entries

    return entries


def _penalty_data(
    params: list[SamplingParams], entries: Callable[[int], np.ndarray], device: torch.device
) -> PenaltyData | None:
    rows = [i for i, p in enumerate(params) if _uses_penalty(p)]
    if not rows:
        return None
    pp = [params[i] for i in rows]
    values = [[float(p.repetition_penalty) for p in pp], [float(p.presence_penalty) for p in pp],
              [float(p.frequency_penalty) for p in pp]]
    return PenaltyData(
        rows=index_tensor(rows, device),
        params=to_device(torch.tensor(values, dtype=torch.float32), device),
        entries=to_device(pack_entries([entries(i) for i in rows]), device),
    )


def _blocked(
    params: list[SamplingParams],
    eos: SequenceABC[SequenceABC[int]],
    positions: SequenceABC[int],
    vocab_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor | None]:
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens <= int(positions[i]):
            continue
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids |= set(eos[i])
        for t in sorted(stop_ids):
            if 0 <= t < vocab_size:
                rows.append(i)
                tokens.append(t)
    if not rows:
        return {"blocked_rows": None, "blocked_tokens": None}
    return {
        "blocked_rows": to_device(torch.tensor(rows, dtype=torch.int64), device),
        "blocked_tokens": to_device(torch.tensor(tokens, dtype=torch.int64), device),
    }
