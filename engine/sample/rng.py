"""Counter-based randomness for sampling, and the stable seed derivation.

Two contracts live here; both are part of deepinfer's reproducibility promise, so changing either
changes every sampled output ever produced (bump the fingerprint version if you must):

1. `derive_seed(*parts)` — a 63-bit seed from ints/strings/bytes (and lists of them) through BLAKE2b.
   The engine derives a request's seed from (engine seed, prompt token ids, params fingerprint) when
   the request has none; the pipeline derives a row's seed from (job seed, row id).

2. The draw for (request seed, output position, vocab index) — `random_bits`/`gumbel_noise`. It is a pure
   function of those three integers (a splitmix64-style stream), evaluated with torch int64 ops that give
   the same bits on CPU and CUDA. No draw depends on other requests, on the batch, or on step order, so a
   preempted-and-recomputed request draws the same noise again.

Torch has no uint64: int64 arithmetic wraps modulo 2**64 (two's complement), which is exactly the unsigned
arithmetic the mixer needs, except for right shifts, which are arithmetic on int64; `_shr` masks off the
sign-extended bits to get a logical shift.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_right
from collections.abc import Sequence as SequenceABC
from functools import partial
from itertools import chain
from typing import Any

import torch
from deepinfer.engine.sample.params import SamplingParams

_MASK64 = (1 << 64) - 1


def to_int64(value: int) -> int:
    """Reduce an arbitrary Python int modulo 2**64 and reinterpret it as a signed int64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = to_int64(0x9E3779B97F4A7C15)     # splitmix64 increment (2**64 / golden ratio)
_MUL1 = to_int64(0xBF58476D1CE4E5B9)       # splitmix64 finalizer multipliers
_MUL2 = to_int64(0x94D049BB133111EB)
_POS_STEP = to_int64(0xD1B54A32D192ED03)   # odd constant separating output positions
_UNIFORM_BITS = 52                          # u = (top 52 bits + 1/2) / 2**52: strictly inside (0, 1)


# ---------------------------------------------------------------------------------------------------------
# Pure-Python reference of the mixer (the tests compare the tensor version against it).

def mix64_int(z: int) -> int:
    """splitmix64 finalizer on an unsigned 64-bit Python int (returns an unsigned int)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def random_bits_int(seed: int, position: int, token: int) -> int:
    """Reference for `random_bits`: the unsigned 64-bit draw for one (seed, position, token)."""
    key = mix64_int(seed + 0x9E3779B97F4A7C15)
    key = mix64_int(key + (position + 1) * 0xD1B54A32D192ED03)
    return mix64_int(key + (token + 1) * 0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------------------
# Tensor version (int64, wrapping).

def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer, elementwise on int64 tensors holding 64-bit patterns (a bijection)."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row stream keys [S] from int64 seeds [S] and output positions [S]."""
    key = mix64(seeds + _GOLDEN)
    return mix64(key + (positions + 1) * _POS_STEP)


def random_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) per (row key, token id): keys [S] x token_ids [V] or [S, C] -> [S, V|C]."""
    if token_ids.dim() == 1:
        token_ids = token_ids.unsqueeze(0)
    return mix64(keys.unsqueeze(1) + (token_ids + 1) * _GOLDEN)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """float64 in [2**-53, 1 - 2**-53] from the top 52 bits: (top + 1/2) / 2**52, every step exact."""
    top = _shr(bits, 64 - _UNIFORM_BITS)
    return (top.to(torch.float64) + 0.5) * (2.0 ** -_UNIFORM_BITS)


def uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 uniforms strictly inside (0, 1) for each (row key, token id)."""
    return bits_to_uniform(random_bits(keys, token_ids))


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 standard Gumbel noise -log(-log u) for each (row key, token id); always finite."""
    return -torch.log(-torch.log(uniforms(keys, token_ids)))


# ---------------------------------------------------------------------------------------------------------
# Seed derivation.

_POWERS_OF_TEN = [10**k for k in range(1, 19)]
_digits_less_one = partial(bisect_right, _POWERS_OF_TEN)      # non-negative ints below 10**18
_INT_TAGS = [f"i{k}:" for k in range(1, 20)]                   # `_encode`'s tag of an int of k digits
ONE_PASS_ID_LIMIT = _POWERS_OF_TEN[-1]   # token ids below this are formatted in one pass (seed_batch too)


def _token_ids(part: Any) -> bool:
    """A non-empty list or tuple of plain ints in [0, ONE_PASS_ID_LIMIT): `_encode`'s one-pass case."""
    return (isinstance(part, (list, tuple)) and len(part) > 0 and set(map(type, part)) == {int}
            and min(part) >= 0 and max(part) < ONE_PASS_ID_LIMIT)


def _encode(part: Any, out: list[bytes]) -> None:
    """Type-tagged, length-prefixed encoding: distinct part tuples never encode to the same bytes."""
    if isinstance(part, bool) or part is None:
        out.append(b"n" if part is None else (b"T" if part else b"F"))
    elif isinstance(part, int):
        text = str(part).encode()
        out.append(b"i%d:" % len(text) + text)
    elif isinstance(part, float):
        text = part.hex().encode()
        out.append(b"f%d:" % len(text) + text)
    elif isinstance(part, str):
        data = part.encode("utf-8")
        out.append(b"s%d:" % len(data) + data)
    elif isinstance(part, (bytes, bytearray, memoryview)):
        data = bytes(part)
        out.append(b"b%d:" % len(data) + data)
    elif isinstance(part, SequenceABC):
        out.append(b"l%d:" % len(part))
        if _token_ids(part):
            # A prompt's token ids (131k per generate call of 256 x 512 tokens): the bytes the loop below
            # writes, in one formatting pass at C speed (each id's tag from its digit count).
            tags = map(_INT_TAGS.__getitem__, map(_digits_less_one, part))
            out.append((("%s%d" * len(part)) % tuple(chain.from_iterable(zip(tags, part)))).encode())
            return
        for item in part:
            _encode(item, out)
    else:
        raise TypeError(
            f"derive_seed: cannot hash a {type(part).__name__}; pass ints, floats, strings, bytes, None "
            "or lists/tuples of them"
        )


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed (0 <= seed < 2**63) from `parts`. STABLE CONTRACT: do not change.

    Parts may be int, float, str, bytes, bool, None, or (nested) lists/tuples of these; each is type-tagged
    and length-prefixed, then hashed with BLAKE2b (8-byte digest, personalisation b"deepinfer-seed"), read
    little-endian and shifted right by one bit. Uses: the pipeline's row seed `derive_seed(job_seed, row_id)`;
    the engine's default request seed `request_seed(engine_seed, prompt_token_ids, params)`.
    """
    return seed_of_encoded(len(parts), [encode_parts(parts)])


def encode_parts(parts: SequenceABC[Any]) -> bytes:
    """The encoding `derive_seed` hashes for `parts`, without its header: their concatenation is the
    encoding of the concatenated parts (engine/sample/seed_batch.py builds seeds from such pieces)."""
    chunks: list[bytes] = []
    for part in parts:
        _encode(part, chunks)
    return b"".join(chunks)


def seed_of_encoded(num_parts: int, encoded: list[bytes]) -> int:
    """`derive_seed`'s seed of `num_parts` parts whose encodings, concatenated, are `encoded`."""
    data = b"".join([b"deepinfer-seed/v1|%d|" % num_parts, *encoded])
    digest = hashlib.blake2b(data, digest_size=8, person=b"deepinfer-seed").digest()
    return int.from_bytes(digest, "little") >> 1


# Fields that only decide when to stop or what to report; they are left out of the default seed so that,
# e.g., raising max_tokens extends a request's output instead of changing it. `n` is left out so that sample
# 0 of n is the n=1 output; `structured_outputs` because __post_init__ copies it into json_schema / regex /
# choice, which are fingerprinted (both spellings of a constraint are one request). Fields added later must
# be listed here unless they shape the distribution, or every unseeded output would change.
_NON_DISTRIBUTION_FIELDS = frozenset(
    {"seed", "max_tokens", "stop", "include_stop_str_in_output", "skip_special_tokens", "logprobs",
     "prompt_logprobs", "n", "structured_outputs"}
)
# Distribution fields added after seeds were published: left out at their default, so that requests
# that do not use them keep their seeds (json_schema_mode 'validate' builds another grammar).
_DEFAULT_OMITTED = {"json_schema_mode": "strict"}
_NO_DEFAULT = object()
_FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
)


def params_fingerprint(params: SamplingParams) -> str:
    """Canonical JSON of the SamplingParams fields that shape the per-step distribution (sorted keys)."""
    fields: dict[str, Any] = {}
    for name in params.__dataclass_fields__:
        if name in _NON_DISTRIBUTION_FIELDS:
            continue
        value = getattr(params, name)
        if _DEFAULT_OMITTED.get(name, _NO_DEFAULT) == value:
            continue
        if name in _FLOAT_FIELDS:
            value = float(value)        # temperature=1 and temperature=1.0 are the same request
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name}={value!r} cannot be fingerprinted: must be finite")
        fields[name] = value
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)


def sample_seed(row_seed: int, index: int) -> int:
    """The seed of sample `index` of a request with n > 1 samples. STABLE CONTRACT: do not change.

    Sample 0 keeps the request's seed (so n=1 outputs never change); sample i > 0 draws from
    `derive_seed(row_seed, "sample", i)`, independent of n, of the other samples and of the batch.
    """
    if index == 0:
        return row_seed
    return derive_seed(row_seed, "sample", index)


def request_seed(engine_seed: int, prompt_token_ids: SequenceABC[int], params: SamplingParams) -> int:
    """The seed of a request without `params.seed`: derived from its own content, never arrival order."""
    if params.seed is not None:
        return params.seed
    return derive_seed(engine_seed, list(prompt_token_ids), params_fingerprint(params))


def request_seed_of_encoded(engine_seed_part: bytes, num_ids: int, ids_text: bytes,
                            fingerprint_part: bytes) -> int:
    """`request_seed`'s derivation from pieces encoded apart: `encode_parts([engine_seed])`, the prompt's
    length and the concatenated `_encode` text of its ids (without the list tag), and
    `encode_parts([params_fingerprint(params)])`."""
    return seed_of_encoded(3, [engine_seed_part, b"l%d:" % num_ids, ids_text, fingerprint_part])
