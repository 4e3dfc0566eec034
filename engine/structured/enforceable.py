"""`json_schema_mode="validate"`: constrain by the enforceable part of a JSON Schema, validate afterwards.

The grammar backend (llguidance) refuses a schema with a keyword it cannot turn into a token mask
(`not`, `contains`, `if`/`then`, `dependentRequired`, a `uniqueItems` over an unbounded item set, ...).
In validate mode the engine builds the grammar from the schema with those keywords removed
(`enforceable_part`) and checks every finished completion against the whole schema with jsonschema
(`validate_completion`; CompletionOutput.schema_valid / schema_error). Dropping a keyword only ever widens
what the grammar admits, so every answer the full schema accepts can still be generated; `oneOf` the
backend cannot prove disjoint is relaxed to `anyOf` (the same widening). The pipeline's
`output_schema_mode: validate` uses the same subsetting (pipeline/spec/enforceable.py). No torch here.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from typing import Any

SCHEMA_MODES = ("strict", "validate")

# Keywords whose value is one subschema, a list of subschemas, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems", "contentSchema")
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_MAX_ROUNDS = 8


def _walk(node: Any, visit) -> Any:
    """Apply `visit` to every schema node (not to property names or other data), bottom-up."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _walk(out[key], visit)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, visit) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(s, visit) for name, s in out[key].items()}
    return visit(out)


def _drop(schema: Any, keywords: set[str]) -> Any:
    return _walk(schema, lambda n: {k: v for k, v in n.items() if k not in keywords})


def _one_of_to_any_of(schema: Any) -> Any:
    def visit(n: dict) -> dict:
        if "oneOf" in n:
            n = dict(n)
            n["anyOf"] = n.pop("oneOf") + n.pop("anyOf", [])
        return n
    return _walk(schema, visit)


def _refused_keywords(problem: str) -> set[str] | None:
    found = re.search(r"Unimplemented keys: \[(.*?)\]", problem)
    if found is None:
        return None
    return {k.strip().strip('"\'') for k in found.group(1).split(",") if k.strip()}


def grammar_problems(schema: Any) -> list[str]:
    """What the grammar backend reports for `schema` (empty when it compiles): the engine's own schema
    preparation, then llguidance with the engine's JSON options."""
    import llguidance
    from deepinfer.engine.structured.normalize import prepare_json_schema

    try:
        prepared = prepare_json_schema(schema)
    except ValueError as exc:
        return [f"json_schema: {exc}"]
    if prepared is False:
        return ["json_schema: the schema `false` accepts no value at all"]
    # The backend's compact-JSON options (llguidance_backend._JSON_OPTIONS; that module needs torch).
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({} if prepared is True else prepared,
                                                                overrides=options)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        problem = str(exc)
    return [f"json_schema: not supported by constrained decoding: {problem.strip()}"] if problem else []


def enforceable_part(schema: Any, problems_of: Callable[[Any], list[str]] = grammar_problems
                     ) -> tuple[Any, list[str], list[str]]:
    """(schema for the grammar, keywords dropped or relaxed, problems left). `problems` is empty when the
    returned schema compiles; a schema that is not a valid JSON Schema comes back with its problem.
    `problems_of` asks the backend about a schema (the pipeline passes its torch-free probe)."""
    current: Any = copy.deepcopy(schema)
    dropped: list[str] = []
    for _ in range(_MAX_ROUNDS):
        problems = problems_of(current)
        if not problems:
            return current, dropped, []
        text = " ".join(problems)
        keywords = _refused_keywords(text)
        if keywords:
            current = _drop(current, keywords)
            dropped += sorted(keywords - set(dropped))
        elif "oneOf" in text:
            current = _one_of_to_any_of(current)
            dropped.append("oneOf (as anyOf)")
        elif "uniqueItems" in text:  # too many combinations to rewrite into the grammar
            current = _drop(current, {"uniqueItems"})
            dropped.append("uniqueItems")
        else:
            return current, dropped, problems
    return current, dropped, problems_of(current)


@functools.lru_cache(maxsize=256)
def _grammar_schema(canonical: str) -> Any:
    grammar, _, problems = enforceable_part(json.loads(canonical))
    if problems:
        raise ValueError(f"json_schema_mode='validate': even the enforceable part of the schema cannot be "
                         f"compiled: {'; '.join(problems)}")
    return grammar


def grammar_schema(schema: Any) -> Any:
    """The schema a validate-mode request's grammar is built from (cached; ValueError when even that
    cannot be compiled)."""
    return _grammar_schema(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _validator(canonical: str) -> Any:
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise ValueError("json_schema_mode='validate' needs the jsonschema package (pip install jsonschema)"
                         ) from None
    return Draft202012Validator(json.loads(canonical))


def check_validator(schema: Any) -> None:
    """Raise ValueError now (at request time) when the schema cannot be validated against."""
    _validator(json.dumps(schema, sort_keys=True))


def validate_completion(text: str, schema: Any) -> tuple[bool, str | None]:
    """(valid, why not) of a finished completion against the whole schema: its text must be JSON that the
    schema accepts (a completion cut at max_tokens is usually not JSON: invalid, saying so)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"not valid JSON: {exc.msg} at char {exc.pos}"
    error = next(iter(_validator(json.dumps(schema, sort_keys=True)).iter_errors(value)), None)
    if error is None:
        return True, None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return False, f"does not match the schema at {where}: {error.message}"
