"""The default seeds of a whole `generate` call at once: `request_seeds` gives, for every request, exactly
`rng.request_seed(engine_seed, prompt_token_ids, params)` (the stable contract lives in rng.py), with every
prompt's token ids encoded in one vectorised pass instead of one Python formatting pass per request.

Why: `derive_seed` hashes a type-tagged decimal text of the prompt ("i6:151234i3:101..."). Formatting
512 ids costs ~150-200 µs of Python, so 256 prompts spent ~50 ms building their seeds before the first step
(the 0.5B benchmark's whole run is ~0.8 s on the H200). Here the text of all ids is built as one uint8
matrix — a row per id: "i", the digit count's one or two digits, ":", the id's digits right-aligned, zero
bytes as padding — whose non-zero bytes, in order, are exactly that text; each prompt's slice of it then
goes into the same BLAKE2b as `derive_seed` (`rng.request_seed_of_encoded`). Prompts the vectorised path does
not cover (ids that are not plain ints in [0, rng.ONE_PASS_ID_LIMIT), e.g. bools, which the contract encodes
as "T"/"F") take `request_seed` itself.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from itertools import chain

import numpy as np
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.sample.rng import (
    ONE_PASS_ID_LIMIT,
    encode_parts,
    params_fingerprint,
    request_seed,
    request_seed_of_encoded,
)

_ZERO, _COLON, _I = 48, 58, 105   # ASCII "0", ":", "i"


def fingerprint_parts(params_list: SequenceABC[SamplingParams]) -> dict[int, bytes]:
    """The encoded fingerprint of every distinct params object (by id) without its own seed, as
    `request_seeds` hashes it; ValueError names the first request whose params no seed can be derived
    from (e.g. temperature=inf). Lets a caller refuse such a request before any runs and then build the
    seeds chunk by chunk (LLM.generate)."""
    parts: dict[int, bytes] = {}
    for i, params in enumerate(params_list):
        if params.seed is None and id(params) not in parts:
            try:
                parts[id(params)] = encode_parts([params_fingerprint(params)])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
    return parts


def request_seeds(engine_seed: int, prompts: SequenceABC[SequenceABC[int]],
                  params_list: SequenceABC[SamplingParams],
                  fingerprints: dict[int, bytes] | None = None) -> list[int]:
    """`request_seed(engine_seed, prompts[i], params_list[i])` for every i (a request's own seed where its
    params give one). `fingerprints`: `fingerprint_parts` of these params (or of a list holding them),
    reused instead of encoding each distinct params object again."""
    if len(prompts) != len(params_list):
        raise ValueError(f"request_seeds: {len(prompts)} prompts but {len(params_list)} SamplingParams")
    seeds: list[int | None] = [p.seed for p in params_list]
    todo = [i for i, s in enumerate(seeds) if s is None]
    if not todo:
        return seeds   # type: ignore[return-value]
    ids = _id_matrix_input([prompts[i] for i in todo])
    if ids is None:   # outside the vectorised path: the contract's own code, request by request
        for i in todo:
            try:
                seeds[i] = request_seed(engine_seed, prompts[i], params_list[i])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return seeds   # type: ignore[return-value]
    text, ends = _encode_ids(ids, [len(prompts[i]) for i in todo])
    head = encode_parts([engine_seed])
    if fingerprints is None:
        fingerprints = fingerprint_parts(params_list)   # raises, naming the request
    start = 0
    for i, end in zip(todo, ends.tolist()):
        fp = fingerprints[id(params_list[i])]
        seeds[i] = request_seed_of_encoded(head, len(prompts[i]), text[start:end], fp)
        start = end
    return seeds   # type: ignore[return-value]   (every None was filled)


def _id_matrix_input(lists: list[SequenceABC[int]]) -> np.ndarray | None:
    """All ids of `lists` as one int64 array, or None when some list is empty or holds anything but plain
    ints in [0, ONE_PASS_ID_LIMIT) (the cases `rng._encode` does not format in its one-pass form; its own
    check, `rng._token_ids`, takes Python's min and max: twice this range check's time here)."""
    if not all(lists):
        return None
    flat = list(chain.from_iterable(lists))
    if set(map(type, flat)) != {int}:
        return None
    try:
        arr = np.array(flat, dtype=np.int64)
    except OverflowError:
        return None
    if arr.min() < 0 or arr.max() >= ONE_PASS_ID_LIMIT:
        return None
    return arr


def _encode_ids(ids: np.ndarray, lengths: list[int]) -> tuple[bytes, np.ndarray]:
    """(the concatenated "i<k>:<digits>" text of `ids`, the end offset in it of each run of `lengths` ids)."""
    ndig = np.ones(ids.shape, dtype=np.int64)
    power = 10
    while power <= int(ids.max()):
        ndig += ids >= power
        power *= 10
    width = int(ndig.max())
    rows = np.zeros((ids.size, 4 + width), dtype=np.uint8)
    rows[:, 0] = _I
    two = ndig >= 10
    rows[:, 1] = np.where(two, _ZERO + 1, _ZERO + ndig)
    rows[:, 2] = np.where(two, _ZERO + ndig - 10, 0)   # 0: padding, dropped
    rows[:, 3] = _COLON
    rest = ids.copy()
    for k in range(width):      # least significant digit first, right-aligned
        col = 4 + width - 1 - k
        rows[:, col] = np.where(k < ndig, _ZERO + rest % 10, 0)
        rest //= 10
    text = rows[rows != 0].tobytes()
    per_id = 3 + two + ndig
    counts = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(per_id)[np.cumsum(counts) - 1]
    return text, ends
