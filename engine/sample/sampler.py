"""Deterministic, batch-invariant, per-request-seeded sampling.

Order of operations for each row (vLLM-like):
  float32 logits (the caller has already applied any structured-output mask)
  -> repetition penalty (tokens in prompt + output: positive logits / r, negative logits * r)
  -> presence / frequency penalties (output-token counts)
  -> min_tokens (EOS and stop_token_ids set to -inf while fewer than min_tokens outputs)
  -> temperature: 0 => greedy argmax (ties -> lowest token id; consumes no randomness); else x = logits / T
  -> top-k -> top-p -> min-p (each narrows the set of kept tokens)
  -> draw: argmax over kept tokens of x_i + G_i, G_i = -log(-log u_i) Gumbel noise.
Logprobs (params.logprobs = n): log-softmax of the RAW logits for the sampled token and the top-n tokens,
and the sampled token's rank (1 + tokens before it in (logit desc, id asc) order: the order top-n uses).

Why the draw is exact: for independent standard Gumbel G_i, argmax_i (x_i + G_i) over a set K is
distributed as softmax(x) restricted to K and renormalised (the Gumbel-max theorem), which is the filtered
distribution. u_i is a pure function of (request seed, output position, token id) (see rng.py), so a
request draws the same noise whatever batch it is in, and a preempted-and-recomputed request samples the
same tokens.

Why it is batch-invariant (`sample(batch)[i] == sample(batch[i:i+1])` bitwise): every step is either
elementwise, an exact reduction (max, argmax, comparison counts), a sort/top-k (exact permutations; ties
broken by token id), or an integer sum. Softmax masses (for top-p and logprobs) are summed as fixed-point
int64 (each exp(x - max) scaled by 2**K and truncated, K = 62 - ceil(log2 V) so V terms cannot overflow):
integer addition is associative, so the sum does not depend on how a kernel splits the row, which varies
with the batch shape on GPUs. The truncation moves each mass by < 2**-K relative to the top token, far
below float32 resolution. Filters run only on the rows that need them; for the other rows they would be
identities, so skipping them changes nothing. Rows are processed in fixed-size row chunks to bound scratch
memory; rows are independent, so chunking changes nothing either. This relies on elementwise exp/log giving
an element the same bits wherever it sits in a tensor (true of torch's CPU kernels, whose vectorised loops
also handle the tail elements, and of CUDA's per-element kernels); the tests check it on CPU.

Tie rules: top-k keeps exactly k tokens, the first k in (logit descending, token id ascending) order;
top-p keeps the shortest prefix of that order whose mass reaches top_p (the top token always); min-p keeps
tokens with p_i >= min_p * p_max, computed as exp(x_i - x_max) >= min_p (no normalisation needed).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.penalties import apply_blocked, apply_penalties
from deepinfer.engine.sample.rng import gumbel_noise, row_keys
from deepinfer.kernels.reference.sampling import apply_bitmask_ref


class SampledLogprobs(dict[int, float]):
    """token id -> logprob of one position: the sampled (or actual prompt) token first, then the top-n in
    rank order. A dict, so it compares and iterates as the plain dicts it replaced; `rank` carries the first
    token's rank along the same path (runner -> scheduler -> sequence) without a parallel list."""

    __slots__ = ("rank",)

    def __init__(self, items: dict[int, float], rank: int) -> None:
        super().__init__(items)
        self.rank = rank


@dataclass
class SamplerOutput:
    """Sampled token per row, and the logprob dicts (sampled token first, then the top-n by rank)."""

    token_ids: torch.Tensor                    # int64 [S], on the logits' device
    logprobs: list[dict[int, float] | None]    # per row (a SampledLogprobs); None where not requested


def fixed_point_bits(vocab_size: int) -> int:
    """K such that V values in [0, 2**K] sum below 2**62 (headroom for the float64 threshold math)."""
    return 62 - (vocab_size - 1).bit_length()


def first_k_mask(x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Bool [R, V]: the first k[r] tokens of row r in (value descending, index ascending) order.

    Uses topk only for the k-th value; ties at that value are resolved by index with an integer cumsum,
    so the result is a pure function of the row whatever order topk returns ties in.
    """
    kth = torch.topk(x, k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    above = x > kth
    tie = x == kth
    room = k.unsqueeze(1) - above.sum(dim=1, keepdim=True)
    return above | (tie & (torch.cumsum(tie.to(torch.int64), dim=1) <= room))


def top_k_top_p_mask(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [R, V]: top-k then top-p (over the top-k renormalised distribution) for rows of scaled logits."""
    vocab = x.shape[1]
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=x.device)
    in_k = rank.unsqueeze(0) < k.unsqueeze(1)
    mass = _fixed_point_mass(xs, xs[:, :1], vocab)
    mass = torch.where(in_k, mass, torch.zeros_like(mass))
    cum = torch.cumsum(mass, dim=1)
    total = cum[:, -1]
    threshold = torch.ceil(total.to(torch.float64) * top_p).to(torch.int64)
    # float64(total) may round below total; top_p >= 1 must keep every top-k token regardless.
    threshold = torch.where(top_p >= 1.0, torch.full_like(threshold, torch.iinfo(torch.int64).max), threshold)
    keep_sorted = in_k & ((cum - mass) < threshold.unsqueeze(1)) & (xs > float("-inf"))
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool [R, V]: tokens whose probability is at least min_p times the top token's."""
    top = x.max(dim=1, keepdim=True).values
    return torch.exp(x - _finite(top)) >= min_p.unsqueeze(1)


def raw_logprobs(raw: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of float32 rows [L, V], with the normaliser summed in exact fixed point."""
    bits = fixed_point_bits(raw.shape[1])
    top = _finite(raw.max(dim=1, keepdim=True).values).to(torch.float64)
    shifted = raw.to(torch.float64) - top
    mass = (torch.exp(shifted) * (2.0 ** bits)).to(torch.int64).sum(dim=1, keepdim=True)
    return shifted - torch.log(mass.to(torch.float64) * (2.0 ** -bits))


def gumbel_argmax(
    x: torch.Tensor, keys: torch.Tensor, vocab_ids: torch.Tensor, keep: torch.Tensor | None
) -> torch.Tensor:
    """argmax over kept tokens of x + Gumbel(key, token) in float64: a draw from softmax(x) over `keep`."""
    score = x.to(torch.float64) + gumbel_noise(keys, vocab_ids)
    if keep is not None:
        score = score.masked_fill(~keep, float("-inf"))
    return torch.argmax(score, dim=1)


# Rows per chunk = max(1, this // V): bounds each [rows, V] temporary (int64/float64) to ~128 MiB so a
# 256 x 128k batch does not need gigabytes of scratch. Rows are independent, so chunking changes no result.
_CHUNK_ELEMENTS = 1 << 24


def _by_row_chunks(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    rows, vocab = tensors[0].shape
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if rows <= step:
        return fn(*tensors)
    return torch.cat([fn(*(t[i : i + step] for t in tensors)) for i in range(0, rows, step)])


def _fixed_point_mass(x: torch.Tensor, top: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 exp(x - top) * 2**K, truncated (exact for float32 x; the top token maps to exactly 2**K)."""
    return (torch.exp(x - _finite(top)) * (2.0 ** fixed_point_bits(vocab))).to(torch.int64)


@cache
def _triton_ok() -> bool:
    # Cached per process: whether Triton imports does not change while the engine runs.
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: the torch path serves
        return False
    return True


def _finite(top: torch.Tensor) -> torch.Tensor:
    # A row of all -inf would give nan from -inf - -inf; shift by 0 instead (every mass is then 0).
    return torch.where(torch.isfinite(top), top, torch.zeros_like(top))


class Sampler:
    """`Sampler()(logits [S, V] float32, meta) -> SamplerOutput`. Stateless; does not modify `logits`.

    Lower-precision float logits are upcast to float32 (exactly) first.

    At least one token per row must have a finite logit (the structured-output mask never removes all).

    `bitmask` (int32 [slots, ceil(V/32)]) with `bitmask_slots` (int [S], -1 = unconstrained) masks rows here
    instead of in the caller: disallowed tokens count as -inf logits everywhere, logprobs included.

    The kernels draw every row when `use_kernel` allows it (None: CUDA logits, Triton present, env
    DEEPINFER_DISABLE_SAMPLING_KERNEL unset or 0; True: any device, e.g. CPU under TRITON_INTERPRET=1;
    False: never) and the metadata was built `for_kernel`: kernels/sampling.py the greedy and
    plain-temperature rows in one read of the logits, kernels/sampling_filter.py the rows with top-k/
    top-p/min-p (no sort). Both give the torch path's ids bit for bit (tests/kernels/test_sampling_*.py).
    Penalties (kernels/penalties.py, on the sparse entries of the tokens each row has seen) and min_tokens
    are applied before, on a float32 copy of the logits.
    """

    def __init__(self, use_kernel: bool | None = None) -> None:
        if use_kernel is None and os.environ.get("DEEPINFER_DISABLE_SAMPLING_KERNEL", "0") not in ("", "0"):
            use_kernel = False
        self.use_kernel = use_kernel

    def _kernel_on(self, logits: torch.Tensor, meta: SamplingMetadata) -> bool:
        if meta.row_params is None or self.use_kernel is False:
            return False
        if self.use_kernel is None:
            return logits.is_cuda and _triton_ok()
        return True

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None = None,
                 bitmask_slots: torch.Tensor | None = None) -> SamplerOutput:
        self._check(logits, meta)
        if (bitmask is None) != (bitmask_slots is None):
            raise ValueError("Sampler: pass bitmask and bitmask_slots together (or neither)")
        kernel = self._kernel_on(logits, meta)
        # The kernels mask as they read; every other consumer of the logits needs them masked first.
        fuse_mask = kernel and not meta.needs_logprobs
        if bitmask is not None and bitmask_slots is not None and not fuse_mask:
            logits = apply_bitmask_ref(logits.to(torch.float32), bitmask, bitmask_slots)
            bitmask = bitmask_slots = None
        if kernel:
            return self._kernel_call(logits, meta, bitmask, bitmask_slots)
        meta = meta.with_draw_fields()
        logits = logits.to(torch.float32)   # exact for bf16/fp16 logits; a no-op for float32
        work = logits
        if meta.penalties is not None or meta.blocked_rows is not None:
            work = logits.clone()
            if meta.penalties is not None:
                apply_penalties(work, meta.penalties)
            if meta.blocked_rows is not None and meta.blocked_tokens is not None:
                apply_blocked(work, meta.blocked_rows, meta.blocked_tokens)

        if meta.all_greedy:
            token_ids = torch.argmax(work, dim=1)
        else:
            token_ids = torch.empty(meta.num_rows, dtype=torch.int64, device=logits.device)
            if meta.greedy_rows.numel():
                greedy = torch.argmax(work.index_select(0, meta.greedy_rows), dim=1)
                token_ids.index_copy_(0, meta.greedy_rows, greedy)
            token_ids.index_copy_(0, meta.sample_rows, self._draw(work, meta))

        logprobs: list[dict[int, float] | None] = [None] * meta.num_rows
        if meta.needs_logprobs:
            logprobs = self._logprobs(logits, token_ids, meta)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _kernel_call(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None,
                     bitmask_slots: torch.Tensor | None) -> SamplerOutput:
        from deepinfer.kernels.sampling import sample_tokens
        from deepinfer.kernels.sampling_filter import sample_filtered

        assert meta.row_params is not None
        work = logits if logits.stride(-1) == 1 else logits.contiguous()
        if meta.penalties is not None or meta.blocked_rows is not None:
            work = logits.to(torch.float32, copy=True)
            if meta.penalties is not None:
                apply_penalties(work, meta.penalties, kernel=True)
            if meta.blocked_rows is not None and meta.blocked_tokens is not None:
                apply_blocked(work, meta.blocked_rows, meta.blocked_tokens)
        token_ids = sample_tokens(work, meta.row_params, bitmask, bitmask_slots)
        if meta.filter_params is not None:
            # Rows with top-k/top-p/min-p: the one-pass kernel skipped them (T < 0); the filter kernels
            # draw them.
            drawn = sample_filtered(work, meta.filter_params, bitmask, bitmask_slots)
            token_ids.index_copy_(0, meta.filter_params[0], drawn)
        logprobs: list[dict[int, float] | None] = [None] * meta.num_rows
        if meta.needs_logprobs:
            logprobs = self._logprobs(logits.to(torch.float32), token_ids, meta)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _check(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        if logits.dim() != 2 or not logits.dtype.is_floating_point:
            raise ValueError(
                f"Sampler: logits must be float [S, V], got {logits.dtype} {tuple(logits.shape)}"
            )
        if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"Sampler: logits shape {tuple(logits.shape)} does not match the metadata "
                f"({meta.num_rows} rows, vocab {meta.vocab_size})"
            )
        if logits.device != meta.device and not (logits.device.type == meta.device.type == "cuda"
                                                   and meta.device.index is None):
            raise ValueError(f"Sampler: logits on {logits.device} but metadata built for {meta.device}")

    @staticmethod
    def _draw(work: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Token ids for meta.sample_rows (in that order)."""
        x = work.index_select(0, meta.sample_rows) / meta.temperature.unsqueeze(1)
        keep: torch.Tensor | None = None

        def narrow(idx: torch.Tensor, mask: torch.Tensor) -> None:
            nonlocal keep
            if keep is None:
                keep = torch.ones_like(x, dtype=torch.bool)
            keep.index_copy_(0, idx, keep.index_select(0, idx) & mask)

        if meta.top_k_only_idx is not None:
            idx = meta.top_k_only_idx
            k_max = meta.top_k_only_max
            narrow(idx, _by_row_chunks(lambda xc, kc: first_k_mask(xc, kc, k_max),
                                       x.index_select(0, idx), meta.top_k.index_select(0, idx)))
        if meta.top_p_idx is not None:
            idx = meta.top_p_idx
            narrow(idx, _by_row_chunks(top_k_top_p_mask, x.index_select(0, idx),
                                       meta.top_k.index_select(0, idx), meta.top_p.index_select(0, idx)))
        if meta.min_p_idx is not None:
            idx = meta.min_p_idx
            narrow(idx, _by_row_chunks(min_p_mask, x.index_select(0, idx), meta.min_p.index_select(0, idx)))

        vocab_ids = torch.arange(meta.vocab_size, dtype=torch.int64, device=x.device)
        keys = row_keys(meta.seeds, meta.positions)
        if keep is None:
            return _by_row_chunks(lambda xc, kc: gumbel_argmax(xc, kc, vocab_ids, None), x, keys)
        return _by_row_chunks(lambda xc, kc, mc: gumbel_argmax(xc, kc, vocab_ids, mc), x, keys, keep)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata
    ) -> list[dict[int, float] | None]:
        rows = [i for i, n in enumerate(meta.num_logprobs) if n is not None]
        counts = [meta.num_logprobs[i] or 0 for i in rows]
        row_idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        entries = position_logprobs(logits.index_select(0, row_idx), token_ids.index_select(0, row_idx),
                                    counts)
        out: list[dict[int, float] | None] = [None] * meta.num_rows
        for i, entry in zip(rows, entries, strict=True):
            out[i] = entry
        return out


def token_ranks(raw: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """int64 [L]: rank of chosen[r] in row r of raw [L, V] by (logit desc, id asc); 1 = the argmax.

    Counted exactly (comparisons and an integer sum), so the rank is batch-invariant, and it agrees with
    the order `first_k_mask` picks the top-k in."""
    value = raw.gather(1, chosen.unsqueeze(1))
    ids = torch.arange(raw.shape[1], device=raw.device).unsqueeze(0)
    before = (raw > value) | ((raw == value) & (ids < chosen.unsqueeze(1)))
    return before.sum(dim=1) + 1


def position_logprobs(raw: torch.Tensor, chosen: torch.Tensor, counts: list[int]) -> list[SampledLogprobs]:
    """Per row of raw float32 logits [L, V]: the chosen token's logprob and rank plus the top-counts[r].

    Used for sampled tokens (the sampler) and for prompt tokens (runner/prompt_logprobs.py)."""
    vocab = raw.shape[1]
    lp = raw_logprobs(raw)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    ranks = token_ranks(raw, chosen).tolist()
    top_ids: list[list[int]] = [[] for _ in counts]
    top_lps: list[list[float]] = [[] for _ in counts]
    k_max = max(counts, default=0)
    if k_max > 0:
        k = torch.tensor([min(max(c, 1), vocab) for c in counts], dtype=torch.int64).to(raw.device)
        mask = first_k_mask(raw, k, min(k_max, vocab))
        # Per row at most k_max hits; gather them ordered by (logit desc, id asc) on the host.
        r_idx, t_idx = mask.nonzero(as_tuple=True)
        vals = lp[r_idx, t_idx].tolist()
        for r, t, v in zip(r_idx.tolist(), t_idx.tolist(), vals, strict=True):
            if counts[r] > 0:
                top_ids[r].append(t)
                top_lps[r].append(v)
    out: list[SampledLogprobs] = []
    for j in range(len(counts)):
        entry = {chosen_ids[j]: chosen_lp[j]}
        for v, t in sorted(zip(top_lps[j], top_ids[j], strict=True), key=lambda p: (-p[0], p[1])):
            entry.setdefault(t, v)
        out.append(SampledLogprobs(entry, ranks[j]))
    return out
