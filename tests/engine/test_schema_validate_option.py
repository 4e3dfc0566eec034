"""The engine option behind `output_schema_mode: validate`: `SamplingParams(json_schema_mode="validate")`
(or `StructuredOutputsParams(json=..., json_schema_mode="validate")`) constrains generation by the
enforceable part of a schema the grammar cannot fully enforce and reports, per completion, whether the
answer satisfies the whole schema (checked here independently with jsonschema) and why not.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from deepinfer.engine import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.engine.sample.rng import params_fingerprint

# `contains` cannot be enforced by the grammar: a tiny random model writes arrays with and without "c"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tags"],
          "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                  "maxItems": 2, "contains": {"const": "c"}}}}
ENFORCEABLE = {**SCHEMA, "properties": {"tags": {k: v for k, v in SCHEMA["properties"]["tags"].items()
                                                 if k != "contains"}}}
PROMPTS = [[1, 5 + i, 9, 13] for i in range(16)]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), device="cpu", cpu_kv_cache_gib=0.25)


def _params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=40, seed=seed, **kw)


def _expected(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.Draft202012Validator(SCHEMA).is_valid(value)


def test_validate_mode_reports_each_completion_against_the_whole_schema(llm) -> None:
    with pytest.raises(ValueError, match="contains"):  # the default stays strict, naming the keyword
        llm.generate([PROMPTS[0]], [_params(0, json_schema=SCHEMA)])
    outs = llm.generate(PROMPTS, [_params(i, json_schema=SCHEMA, json_schema_mode="validate")
                                  for i in range(len(PROMPTS))])
    verdicts = []
    for out in outs:
        c = out.outputs[0]
        assert c.schema_valid is _expected(c.text), c.text
        assert (c.schema_error is None) is c.schema_valid
        if c.finish_reason == "stop":  # the enforceable part was enforced by the grammar
            jsonschema.validate(json.loads(c.text), ENFORCEABLE)
        if not c.schema_valid and c.finish_reason == "stop":
            assert "tags" in c.schema_error and "contain" in c.schema_error
        verdicts.append(c.schema_valid)
    assert True in verdicts and False in verdicts  # both kinds occur, so the check is not vacuous

    # vLLM's spelling is the same request, with the same outputs and verdicts
    again = llm.generate(PROMPTS[:4], [
        _params(i, structured_outputs=StructuredOutputsParams(json=SCHEMA, json_schema_mode="validate"))
        for i in range(4)])
    assert [(o.text, o.outputs[0].schema_valid) for o in again] == \
           [(o.text, o.outputs[0].schema_valid) for o in outs[:4]]
    plain = llm.generate([PROMPTS[0]], [_params(0, json_schema=ENFORCEABLE)])[0].outputs[0]
    assert plain.schema_valid is None and plain.schema_error is None  # only validate mode reports


def test_json_schema_mode_values_and_seed_fingerprint() -> None:
    with pytest.raises(ValueError, match="json_schema_mode"):
        SamplingParams(json_schema_mode="validate")  # nothing to validate against
    with pytest.raises(ValueError, match="'strict' or 'validate'"):
        SamplingParams(json_schema=SCHEMA, json_schema_mode="loose")
    with pytest.raises(ValueError, match="JSON Schema only"):
        StructuredOutputsParams(regex="a+", json_schema_mode="validate")
    # the default is left out of the unseeded-request fingerprint (existing seeds stay); validate is in it
    assert "json_schema_mode" not in params_fingerprint(SamplingParams(json_schema=SCHEMA))
    assert params_fingerprint(SamplingParams(json_schema=SCHEMA)) != \
           params_fingerprint(SamplingParams(json_schema=SCHEMA, json_schema_mode="validate"))
