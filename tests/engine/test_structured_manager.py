"""StructuredOutputManager: validation before generation, compile cache, masks, EOS, termination, steps."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from deepinfer.engine import SamplingParams
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarSpec,
    Matcher,
)
from deepinfer.engine.structured.manager import StructuredOutputManager
from deepinfer.kernels.reference.token_mask import unpack_bitmask
from tokenizers import Tokenizer

from tests.support.spec_catalog import ALL_CASES, CHOICE_CASES, REJECTED_CASES, case_params_kwargs
from tests.support.structured_demo import EOS_IDS

PAD = 64          # model vocab = tokenizer vocab + PAD padded rows that must stay masked


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured_tok")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab(tok):
    return tok.get_vocab_size() + PAD


@pytest.fixture(scope="module")
def manager(tok_dir, vocab):
    m = StructuredOutputManager(tok_dir / "tokenizer.json", vocab, EOS_IDS, max_threads=1)
    yield m
    m.close()


def _mask(manager, state) -> torch.Tensor:
    bm = manager.allocate_bitmask(1)
    manager.fill_bitmask([(0, state, None)], bm)
    return unpack_bitmask(bm, manager.vocab_size)[0]


def _feed(manager, state, tok, text: str) -> bool:
    return all(manager.accept(state, t) for t in tok.encode(text, add_special_tokens=False).ids)


# ---- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", REJECTED_CASES, ids=lambda c: c.name)
def test_rejected_specs_raise_value_error_naming_the_problem(manager, case):
    params = SamplingParams(**case_params_kwargs(case))
    with pytest.raises(ValueError, match=f"^{case.kind}: ") as err:
        manager.validate(params)
    assert case.message in str(err.value)


def test_unique_items_is_refused_with_a_clear_message(manager):
    with pytest.raises(ValueError, match=r"^json_schema: unsupported keyword 'uniqueItems'"):
        manager.validate(SamplingParams(json_schema={"type": "array", "uniqueItems": True}))


def test_invalid_schema_names_the_location(manager):
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}}
    with pytest.raises(ValueError, match=r"json_schema: invalid schema at /properties/a/minItems"):
        manager.validate(SamplingParams(json_schema=schema))


def test_false_schema_is_refused(manager):
    with pytest.raises(ValueError, match="accepts no value"):
        manager.validate(SamplingParams(json_schema=False))


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_every_supported_case_compiles(manager, case):
    manager.validate(SamplingParams(**case_params_kwargs(case)))


def test_compile_cache_is_shared_by_equal_specs(manager):
    a = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    same = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    compiled = manager.compile(GrammarSpec.of("json_schema", a))
    assert compiled is manager.compile(GrammarSpec.of("json_schema", same))
    assert GrammarSpec.of("json_schema", a).key != GrammarSpec.of("regex", "x").key


def test_property_order_is_part_of_the_spec(manager, tok):
    # Members are generated in `properties` order, so reordered schemas are different grammars.
    props = {"b": {"const": 1}, "a": {"const": 2}}
    first = {"type": "object", "properties": props, "required": ["a", "b"], "additionalProperties": False}
    second = dict(first, properties=dict(reversed(list(props.items()))))
    assert GrammarSpec.of("json_schema", first).key != GrammarSpec.of("json_schema", second).key
    s1 = manager.new_matcher(SamplingParams(json_schema=first))
    s2 = manager.new_matcher(SamplingParams(json_schema=second))
    assert _feed(manager, s1, tok, '{"b": 1, "a": 2}') and manager.is_valid_end(s1)
    assert _feed(manager, s2, tok, '{"a": 2, "b": 1}') and manager.is_valid_end(s2)


def test_new_matcher_needs_a_constraint(manager):
    with pytest.raises(ValueError, match="no json_schema, regex or choice"):
        manager.new_matcher(SamplingParams())


def test_llguidance_backend_implements_the_interface(manager):
    assert isinstance(manager.backend, GrammarBackend)
    grammar = manager.compile(GrammarSpec.of("regex", "a+"))
    assert isinstance(grammar, CompiledGrammar)
    assert isinstance(manager.backend.new_matcher(grammar), Matcher)


# ---- masks, EOS, termination ----------------------------------------------------------------------------
def test_padded_ids_and_special_tokens_are_never_allowed_in_text(manager, tok):
    state = manager.new_matcher(SamplingParams(json_schema={"type": "string"}))
    assert _feed(manager, state, tok, '"abc')
    allowed = _mask(manager, state)
    n = tok.get_vocab_size()
    assert allowed[:n].sum() > 100          # inside a string almost any text token fits
    assert not allowed[n:].any()            # padded rows
    assert not allowed[[0, 2, 4]].any()     # bos, im_start, pad are special, never text
    assert not allowed[list(EOS_IDS)].any()  # the string is open: cannot end


@pytest.mark.parametrize(
    "kwargs,prefix,eos_before,eos_after",
    [
        ({"choice": ["yes", "yes please"]}, "yes", False, True),
        ({"json_schema": {"type": "integer"}}, "12", False, True),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
         '{"a": 1', False, False),
        ({"regex": "[a-c]{2,3}"}, "ab", False, True),
    ],
)
def test_eos_is_allowed_exactly_where_the_grammar_can_end(manager, tok, kwargs, prefix, eos_before,
                                                          eos_after):
    state = manager.new_matcher(SamplingParams(**kwargs))
    assert bool(_mask(manager, state)[list(EOS_IDS)].all()) == eos_before
    assert _feed(manager, state, tok, prefix)
    allowed = _mask(manager, state)
    assert bool(allowed[EOS_IDS[0]]) == eos_after and bool(allowed[EOS_IDS[1]]) == eos_after


def test_terminates_on_eos_or_when_nothing_can_follow(manager, tok):
    state = manager.new_matcher(SamplingParams(choice=["yes", "yes please"]))
    assert _feed(manager, state, tok, "yes") and not manager.is_terminated(state)
    assert manager.accept(state, EOS_IDS[1]) and manager.is_terminated(state)
    state = manager.new_matcher(SamplingParams(choice=["yes", "yes please"]))
    assert _feed(manager, state, tok, "yes please") and manager.is_terminated(state)
    assert manager.is_valid_end(state)


def test_a_rejected_token_is_reported_and_the_output_is_not_a_valid_end(manager, tok):
    state = manager.new_matcher(SamplingParams(json_schema={"type": "boolean"}))
    assert not manager.accept(state, tok.token_to_id("{"))
    assert not manager.is_valid_end(state)


@pytest.mark.parametrize("case", CHOICE_CASES, ids=lambda c: c.name)
def test_choice_grammar_matches_exactly_the_choices(manager, tok, case):
    params = SamplingParams(choice=case.spec)
    for choice in case.spec:
        state = manager.new_matcher(params)
        assert _feed(manager, state, tok, choice), choice
        assert manager.is_valid_end(state), choice
    for other in (case.spec[0] + "!", "x" + case.spec[-1]):
        if other in case.spec:
            continue
        state = manager.new_matcher(params)
        assert not (_feed(manager, state, tok, other) and manager.is_valid_end(state)), other


def test_regex_digit_class_allows_only_ascii_digits(manager):
    # `\d` is rewritten to [0-9]: no UTF-8 lead byte of a non-ASCII digit may start the output.
    state = manager.new_matcher(SamplingParams(regex=r"\d+"))
    allowed = _mask(manager, state).nonzero().flatten().tolist()
    token_bytes = manager.backend.token_bytes()
    assert allowed and all(token_bytes[t] and token_bytes[t].isdigit() for t in allowed)


def test_same_tokens_give_the_same_state_so_recompute_needs_nothing(manager, tok):
    # A preempted request is recomputed from its tokens; its matcher is untouched by that, and a matcher
    # rebuilt from the same output tokens (or rolled back and re-fed) is in the same state.
    params = SamplingParams(json_schema=ALL_CASES[0].spec)
    a, b = manager.new_matcher(params), manager.new_matcher(params)
    assert _feed(manager, a, tok, '{"name": "Al') and _feed(manager, b, tok, '{"name": "Al')
    assert torch.equal(_mask(manager, a), _mask(manager, b))
    before = _mask(manager, a)
    assert _feed(manager, a, tok, 'ice", ') and a.matcher.rollback(len(tok.encode('ice", ').ids))
    assert torch.equal(_mask(manager, a), before)


@pytest.mark.parametrize("source", ["path", "dir", "json", "object"])
def test_tokenizer_can_be_given_as_path_dir_json_or_object(tok_dir, tok, vocab, manager, source):
    given = {"path": tok_dir / "tokenizer.json", "dir": tok_dir, "json": tok.to_str(), "object": tok}[source]
    other = StructuredOutputManager(given, vocab, EOS_IDS, max_threads=1)
    params = SamplingParams(json_schema={"type": "array", "items": {"type": "integer"}})
    assert torch.equal(_mask(other, other.new_matcher(params)), _mask(manager, manager.new_matcher(params)))
    other.close()


@pytest.mark.parametrize(
    "args,message",
    [
        (("missing/tokenizer.json", 600, [1]), "does not exist"),
        ((3.5, 600, [1]), "cannot read a tokenizer"),
        ((None, 100, [1]), "vocab_size=100"),
        ((None, 600, []), "eos_token_ids"),
        ((None, 600, [600]), "eos_token_ids"),
        ((None, 0, [1]), "vocab_size=0"),
    ],
)
def test_bad_construction_arguments_raise_value_error(tok_dir, args, message):
    src, vocab, eos = args
    with pytest.raises(ValueError, match=message):
        StructuredOutputManager(tok_dir if src is None else src, vocab, eos)


# ---- per step ---------------------------------------------------------------------------------------------
def test_fill_bitmask_async_fills_rows_on_the_worker(manager, tok):
    params = SamplingParams(choice=["alpha", "beta"])
    s0, s1 = manager.new_matcher(params), manager.new_matcher(params)
    assert _feed(manager, s1, tok, "al")
    bm = manager.allocate_bitmask(3)
    fut = manager.fill_bitmask_async([(0, s0, None), (2, s1, None)], bm)
    assert isinstance(fut, Future)
    assert fut.result(timeout=30) is None
    assert torch.equal(unpack_bitmask(bm[0:1], manager.vocab_size)[0], _mask(manager, s0))
    assert (bm[1] == -1).all()  # untouched row stays all-allowed
    assert torch.equal(unpack_bitmask(bm[2:3], manager.vocab_size)[0], _mask(manager, s1))


def test_masks_for_masks_only_constrained_rows(manager, tok):
    def seq(params, out_len=0):
        s = SimpleNamespace(params=params, grammar=None, num_output_tokens=out_len, num_tokens=5 + out_len)
        manager.add(s)
        return s

    seqs = [seq(SamplingParams()), seq(SamplingParams(choice=["yes", "no"])), seq(SamplingParams())]
    assert seqs[0].grammar is None and seqs[1].grammar is not None
    job = manager.masks_for(seqs)
    logits = torch.zeros(3, manager.vocab_size)
    job.apply(logits)
    assert torch.equal(logits[0], torch.zeros(manager.vocab_size))
    assert torch.equal(logits[2], torch.zeros(manager.vocab_size))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    texts = {tok.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert manager.masks_for([seqs[0], seqs[2]]) is None


def test_steering_changes_masks_only_near_the_budget_end(manager, tok):
    params = SamplingParams(json_schema={"type": "string"}, max_tokens=40)   # steering from 10 left
    state = manager.new_matcher(params)
    assert _feed(manager, state, tok, '"abc')
    far, near = manager.allocate_bitmask(1), manager.allocate_bitmask(1)
    manager.fill_bitmask([(0, state, 11)], far)
    manager.fill_bitmask([(0, state, 10)], near)
    far_ids = unpack_bitmask(far, manager.vocab_size)[0]
    near_ids = unpack_bitmask(near, manager.vocab_size)[0]
    assert torch.equal(far_ids, _mask(manager, state))
    assert near_ids.sum() < far_ids.sum() and not (near_ids & ~far_ids).any()
    assert all(tok.decode([t]).startswith('"') for t in near_ids.nonzero().flatten().tolist())


@pytest.mark.gpu
def test_step_masks_apply_on_cuda(manager):
    params = SamplingParams(json_schema={"type": "boolean"})
    seqs = [SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=3),
            SimpleNamespace(params=SamplingParams(), grammar=None, num_output_tokens=0, num_tokens=3)]
    for s in seqs:
        manager.add(s)
    job = manager.masks_for(seqs)
    logits = torch.zeros(2, manager.vocab_size, device="cuda")
    job.apply(logits)
    expected = torch.zeros(2, manager.vocab_size)
    expected[0, ~_mask(manager, seqs[0].grammar)] = float("-inf")
    assert torch.equal(logits.cpu(), expected)
