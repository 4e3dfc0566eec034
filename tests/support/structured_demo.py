"""The demo tokenizer and a StructuredOutputManager over it, as the structured-output tests build them.

Each test module takes its own temporary directory (a module-scoped fixture), a model vocabulary some
padded rows wider than the tokenizer's (rows that must stay masked) and the manager options it tests.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from deepinfer.engine import SamplingParams
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.structured.manager import StructuredOutputManager
from tokenizers import Tokenizer

EOS_IDS = (1, 3)  # the demo tokenizer's <|end_of_text|>, <|im_end|>


def demo_tokenizer(directory: Path) -> tuple[Path, int]:
    """The demo tokenizer's files written into `directory`: (its tokenizer.json, the tokenizer's vocab
    size)."""
    write_tokenizer_files(directory)
    path = directory / "tokenizer.json"
    return path, Tokenizer.from_file(str(path)).get_vocab_size()


@contextmanager
def demo_manager(directory: Path, pad: int, **options: Any) -> Iterator[StructuredOutputManager]:
    """A manager over the demo tokenizer written into `directory`, for a model vocabulary `pad` rows wider
    than the tokenizer's, stopping on EOS_IDS; `options` go to StructuredOutputManager. Closed on exit."""
    path, size = demo_tokenizer(directory)
    manager = StructuredOutputManager(path, size + pad, EOS_IDS, **options)
    try:
        yield manager
    finally:
        manager.close()


def allowed_tokens(row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a packed bitmask row [words] allows, ascending."""
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]).tolist()


def checked_walk(manager: StructuredOutputManager, params: SamplingParams, rows: int, steps: int,
                 seed: int) -> list[list[int]]:
    """`rows` requests of `params` through add / masks_for / advance / free in the engine's order, each
    picking a random allowed token (random.Random(seed)) for up to `steps` steps; every step each row's
    mask slot must be bitwise a fresh llguidance fill of its matcher. Returns the tokens each row picked."""
    rng = random.Random(seed)
    seqs = [SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
            for _ in range(rows)]
    for s in seqs:
        manager.add(s)
    fresh = manager.allocate_bitmask(1)
    picked: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        alive = [(i, s) for i, s in enumerate(seqs) if s.grammar is not None]
        if not alive:
            break
        manager.masks_for([s for _, s in alive]).wait()
        for i, s in alive:
            manager.backend.fill_bitmasks([(0, s.grammar.matcher)], fresh)
            assert torch.equal(manager.slots.buffer[s.grammar.slot], fresh[0])
            tok = rng.choice(allowed_tokens(fresh[0], manager.vocab_size))
            picked[i].append(tok)
            s.num_output_tokens += 1
            s.num_tokens += 1
            if manager.advance(s, tok) or s.num_output_tokens >= steps:
                manager.free(s)
    for s in seqs:
        manager.free(s)
    manager.slots.wait_idle()
    return picked
