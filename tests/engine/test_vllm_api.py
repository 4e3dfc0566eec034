"""vLLM's offline API on deepinfer: n samples, Logprob objects, prompt logprobs, dict prompts,
structured_outputs, top_k=0, and uniqueItems over finite item sets (CPU, tiny random-weight Llama)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import jsonschema
import pytest
import torch
from deepinfer.engine import LLM, CompletionOutput, Logprob, SamplingParams, StructuredOutputsParams
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.rng import sample_seed
from deepinfer.engine.structured.normalize import prepare_json_schema

PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running far away", "Hello, my name is"]
TAGS = ["red", "green", "blue", "black", "white", "gray"]
TAGS_SCHEMA = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": TAGS}, "uniqueItems": True, "maxItems": 3}},
    "required": ["tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, device="cpu", cpu_kv_cache_gib=0.25)


@pytest.fixture(scope="module")
def hf_log_softmax(model_dir: str) -> Callable[[list[int]], torch.Tensor]:
    """token ids -> HF transformers' float32 log-softmax of the logits at every position [len, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def _check_position(entry: dict[int, Logprob], lsm: torch.Tensor, chosen: int, k: int) -> None:
    """`entry` holds `chosen` and the top-k of `lsm` (one position's reference log-softmax) exactly."""
    assert next(iter(entry)) == chosen and len(entry) in (k, k + 1)
    top = torch.topk(lsm, k).indices.tolist()
    assert set(entry) == {chosen, *top}
    for tid, lp in entry.items():
        assert isinstance(lp, Logprob) and isinstance(lp.decoded_token, str)
        assert lp.logprob == pytest.approx(lsm[tid].item(), abs=1e-4)
        assert lp.rank == 1 + int((lsm > lsm[tid]).sum())   # ties are far apart on these random weights
    assert entry.get(top[0]) is not None and entry[top[0]].rank == 1


def test_a_vllm_offline_script_runs_unchanged(model_dir: str) -> None:
    # What a user's vLLM script looks like, with only the import changed.
    llm = LLM(model=model_dir)
    sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=8, logprobs=2)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert len(outputs) == len(PROMPTS)
    for o in outputs:
        assert o.prompt in PROMPTS and len(o.outputs) == 2
        for i, c in enumerate(o.outputs):
            assert isinstance(c, CompletionOutput) and c.index == i and isinstance(c.text, str)
            assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids)
            assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        # The single-sample attributes are sample 0's.
        assert (o.text, o.token_ids, o.logprobs) == (o.outputs[0].text, o.outputs[0].token_ids,
                                                      o.outputs[0].logprobs)


def test_n_samples_are_distinct_deterministic_and_batch_invariant(llm: LLM, monkeypatch) -> None:
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True)
    seqs: list[Sequence] = []
    add = llm.engine.add
    monkeypatch.setattr(llm.engine, "add", lambda s: (seqs.append(s), add(s)))
    alone = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    samples = [c.token_ids for c in alone.outputs]
    assert len({tuple(t) for t in samples}) == 4
    # Samples 1..3 took the leader's full prompt blocks from the prefix cache instead of recomputing them.
    assert seqs[0].num_cached_tokens == 0 and all(s.num_cached_tokens > 0 for s in seqs[1:4])
    monkeypatch.undo()
    # Sample 0 is the n=1 output; sample i draws from sample_seed(seed, i).
    one = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert one.token_ids == samples[0]
    assert [c.seed for c in alone.outputs] == [sample_seed(one.seed, i) for i in range(4)]
    # Same samples in another batch (other prompts first, other n) and another scheduling.
    other = SamplingParams(n=3, temperature=0.7, max_tokens=5)
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], "zz"], [other, sp, other], use_tqdm=False)[1]
    assert [c.token_ids for c in mixed.outputs] == samples
    small = LLM(model=str(llm.model_dir), device="cpu", cpu_kv_cache_gib=0.25, max_num_seqs=3,
                max_num_batched_tokens=24, async_scheduling=False)
    again = small.generate(["x", PROMPTS[0]], [other, sp], use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == samples


def test_logprobs_are_log_softmax_of_the_raw_logits_with_ranks(llm: LLM, hf_log_softmax) -> None:
    k = 3
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, logprobs=k, ignore_eos=True, seed=7)
    out = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    for c in out.outputs:
        lsm = hf_log_softmax(out.prompt_token_ids + c.token_ids)
        p = len(out.prompt_token_ids)
        for t, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            _check_position(entry, lsm[p - 1 + t], tok, k)
        total = sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob == pytest.approx(total)
    # Greedy: every sampled token is rank 1.
    greedy = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, logprobs=0),
                          use_tqdm=False)[0]
    assert all(len(e) == 1 and e[t].rank == 1 for t, e in zip(greedy.token_ids, greedy.logprobs))


@pytest.mark.parametrize("chunked", [False, True], ids=["one_prefill", "chunked_prefill"])
def test_prompt_logprobs_match_transformers(llm: LLM, model_dir: str, hf_log_softmax, chunked: bool) -> None:
    engine = llm
    if chunked:  # 16-token chunks: the prompt positions come from several forwards
        engine = LLM(model=model_dir, device="cpu", cpu_kv_cache_gib=0.25, max_num_batched_tokens=16)
    k = 2
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=3, prompt_logprobs=k)
    # Twice the same prompt in one call and once more: prompt logprobs never come from cache hits.
    outs = engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], sp, use_tqdm=False)
    outs += engine.generate([PROMPTS[0]], sp, use_tqdm=False)
    for o in outs:
        ids = o.prompt_token_ids
        lsm = hf_log_softmax(ids)
        assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            _check_position(o.prompt_logprobs[i], lsm[i - 1], ids[i], k)
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs == outs[3].prompt_logprobs
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_dict_prompts(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    plain = llm.generate([PROMPTS[0], ids], sp, use_tqdm=False)
    dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt == PROMPTS[0] and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt": "abc"}, sp, use_tqdm=False)[0].prompt == "abc"
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, {"prompt": [1, 2]}):
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate(["ok", bad], sp, use_tqdm=False)


def test_structured_outputs_is_the_same_request_as_the_old_fields(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    pairs = [
        (dict(structured_outputs=StructuredOutputsParams(json=schema)), dict(json_schema=schema)),
        (dict(structured_outputs={"json": json.dumps(schema)}), dict(json_schema=schema)),
        (dict(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}")), dict(regex="[a-z]{3}")),
        (dict(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), dict(choice=["yes", "no"])),
    ]
    for new, old in pairs:
        # No seed: the derived seed must be the same for both spellings too.
        a, b = (llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=24, **kw),
                             use_tqdm=False)[0] for kw in (new, old))
        assert a.token_ids == b.token_ids and a.text == b.text, new
    any_object = StructuredOutputsParams(json_object=True)
    obj = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=48, seed=1, structured_outputs=any_object),
                       use_tqdm=False)[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert dataclasses.replace(sp, max_tokens=3).regex == "[0-9]+"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(regex="a", structured_outputs=StructuredOutputsParams(choice=["b"]))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=schema, regex="a")


def test_top_k_zero_and_minus_one_both_disable_top_k(llm: LLM) -> None:
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)
    a, b = (llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=k, max_tokens=8), use_tqdm=False)
            for k in (0, -1))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_unique_items_over_tags_gives_valid_duplicate_free_arrays(llm: LLM) -> None:
    sp = SamplingParams(n=200, temperature=1.0, max_tokens=40, seed=11, json_schema=TAGS_SCHEMA)
    out = llm.generate(["Tags: "], sp, use_tqdm=False)[0]
    finished = [c for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 190
    for c in finished:
        value = json.loads(c.text)
        jsonschema.validate(value, TAGS_SCHEMA)
        assert len(set(value["tags"])) == len(value["tags"])
    assert len({tuple(json.loads(c.text)["tags"]) for c in finished}) > 20   # not one array over and over


def test_unique_items_rewrite_and_refusals() -> None:
    def listed(schema: dict) -> list[list]:
        alternatives = prepare_json_schema(schema)["anyOf"]
        return [[p["const"] for p in alt.get("prefixItems", [])] for alt in alternatives]

    small = listed({"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 2})
    assert sorted(small) == sorted([["a", "b"], ["b", "a"], ["a", "c"], ["c", "a"], ["b", "c"], ["c", "b"],
                                    *([x, y, z] for x in "abc" for y in "abc" for z in "abc"
                                      if len({x, y, z}) == 3)])
    # Too many orderings: every subset once, in the order the schema lists the values.
    subsets = listed({"type": "array", "items": {"type": "string", "enum": list("abcdefghij")},
                      "uniqueItems": True, "maxItems": 4})
    assert len(subsets) == 1 + 10 + 45 + 120 + 210 and all(s == sorted(s) for s in subsets)
    assert listed({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}) == [
        [], [False], [True], [False, True], [True, False]]
    # pydantic's `set[Tag]`: the enum sits in $defs behind a $ref.
    pydantic = {"$defs": {"Tag": {"enum": ["x", "y"], "title": "Tag", "type": "string"}},
                "properties": {"tags": {"items": {"$ref": "#/$defs/Tag"}, "type": "array",
                                        "uniqueItems": True}},
                "required": ["tags"], "type": "object"}
    alternatives = prepare_json_schema(pydantic)["properties"]["tags"]["anyOf"]
    assert len(alternatives) == 5 and "uniqueItems" not in json.dumps(alternatives)
    with pytest.raises(ValueError, match="uniqueItems at /properties/t: .* more than the 1500"):
        prepare_json_schema({"properties": {"t": {"type": "array", "items": {"enum": list(range(30))},
                                                  "uniqueItems": True}}})
    with pytest.raises(ValueError, match="no array of 3"):
        prepare_json_schema({"type": "array", "items": {"enum": [1, 1.0, 2]}, "uniqueItems": True,
                             "minItems": 3})
    # Items that are not a finite set keep uniqueItems, which the grammar library refuses as before.
    assert prepare_json_schema({"type": "array", "items": {"type": "string"}, "uniqueItems": True})[
        "uniqueItems"] is True
