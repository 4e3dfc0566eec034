"""A grammar shared by many requests gets one template per mask-fill thread; masks never depend on which."""

from __future__ import annotations

import json
import random

import pytest
import torch
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.structured.backend import GrammarSpec
from deepinfer.kernels.reference.token_mask import unpack_bitmask

llguidance_backend = pytest.importorskip("deepinfer.engine.structured.llguidance_backend")

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["yes", "no"]}, "note": {"type": "string"}},
          "required": ["label", "note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    tok_json = (d / "tokenizer.json").read_text()
    vocab = json.loads(tok_json)["model"]["vocab"]
    return llguidance_backend.LLGuidanceBackend(tok_json, len(vocab) + 64, [1], max_threads=4)


@pytest.mark.parametrize("requests,replicas", [(1, 1), (8, 1), (9, 2), (24, 3), (100, 4)])
def test_replicas_grow_with_the_requests_up_to_the_fill_threads(backend, requests, replicas):
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    for _ in range(requests):
        backend.new_matcher(grammar)
    assert len(grammar.replicas) == replicas
    assert grammar.replicas[0] is grammar.template


def test_matchers_of_every_replica_give_the_same_masks_along_a_walk(backend):
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    matchers = [backend.new_matcher(grammar) for _ in range(32)]
    assert len(grammar.replicas) == 4
    rng = random.Random(0)
    bm = torch.zeros(len(matchers), backend.words, dtype=torch.int32)
    for _ in range(30):
        backend.fill_bitmasks(list(enumerate(matchers)), bm)
        assert all(torch.equal(bm[0], bm[i]) for i in range(1, len(matchers)))
        allowed = unpack_bitmask(bm[:1], backend.vocab_size)[0].nonzero().flatten().tolist()
        if not allowed or matchers[0].is_terminated():
            break
        token = rng.choice(allowed)
        assert all(m.accept_token(token) for m in matchers)
