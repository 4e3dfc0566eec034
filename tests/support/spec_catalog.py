"""The project's table of constraint specs: what structured output must handle, used by tests and benchmarks.

Each `SpecCase` is one request constraint (a JSON Schema, a regex or a list of choices) with a token budget
that a random walk over the demo tokenizer (512 tokens, so short tokens) usually needs. The table covers the
JSON Schema features deepinfer supports; `REJECTED_CASES` lists schemas that must be refused before any
generation with a ValueError naming the problem (invalid schemas and features the grammar backend cannot
enforce — enforcing them partially would produce outputs that do not validate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpecCase:
    name: str
    kind: str          # "json_schema" | "regex" | "choice"
    spec: Any
    max_tokens: int = 96


@dataclass(frozen=True)
class RejectedCase:
    name: str
    kind: str
    spec: Any
    message: str       # a fragment the ValueError message must contain


_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

JSON_SCHEMA_CASES: tuple[SpecCase, ...] = (
    SpecCase("object_required_closed", "json_schema", _PERSON),
    SpecCase("optional_properties", "json_schema", {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "note": {"type": "string", "maxLength": 8},
                       "ok": {"type": "boolean"}},
        "required": ["id"], "additionalProperties": False}),
    SpecCase("enum_strings", "json_schema", {"enum": ["red", "green", "blue"]}, 16),
    SpecCase("enum_mixed", "json_schema", {"enum": ["a", 1, None, True, {"k": [1, 2]}]}, 24),
    SpecCase("const_string", "json_schema", {"const": "fixed value"}, 16),
    SpecCase("const_in_object", "json_schema", {
        "type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "label"}},
        "required": ["version", "kind"], "additionalProperties": False}, 32),
    SpecCase("any_of_scalars", "json_schema", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, 24),
    SpecCase("one_of_discriminated", "json_schema", {"oneOf": [
        {"type": "object",
         "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"], "additionalProperties": False},
    ]}, 48),
    SpecCase("one_of_disjoint_types", "json_schema", {"oneOf": [{"type": "string", "maxLength": 6},
                                                                 {"type": "null"}]}, 24),
    SpecCase("ref_defs", "json_schema", {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False}),
    SpecCase("ref_recursive_tree", "json_schema", {
        "$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}, 128),
    SpecCase("array_min_max_items", "json_schema", {"type": "array", "items": {"type": "integer"},
                                                     "minItems": 1, "maxItems": 3}, 48),
    SpecCase("array_prefix_items", "json_schema", {
        "type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"},
                                         {"type": "boolean"}],
        "items": False, "minItems": 3}, 48),
    SpecCase("array_of_enums", "json_schema", {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                                "maxItems": 4}, 32),
    SpecCase("top_level_array_of_objects", "json_schema", {
        "type": "array", "maxItems": 2,
        "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}},
                  "required": ["k"], "additionalProperties": False}}, 64),
    SpecCase("string_pattern", "json_schema", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, 24),
    SpecCase("string_min_max_length", "json_schema", {"type": "string", "minLength": 3, "maxLength": 6}, 24),
    SpecCase("format_date", "json_schema", {"type": "string", "format": "date"}, 32),
    SpecCase("format_date_time", "json_schema", {"type": "string", "format": "date-time"}, 48),
    SpecCase("format_email", "json_schema", {"type": "string", "format": "email"}, 48),
    SpecCase("format_uuid", "json_schema", {"type": "string", "format": "uuid"}, 48),
    SpecCase("integer_bounds", "json_schema", {"type": "integer", "minimum": -5, "maximum": 120}, 16),
    SpecCase("number_exclusive_bounds", "json_schema", {"type": "number", "exclusiveMinimum": 0,
                                                         "exclusiveMaximum": 1}, 24),
    SpecCase("number_unbounded", "json_schema", {"type": "number"}, 24),
    SpecCase("boolean", "json_schema", {"type": "boolean"}, 8),
    SpecCase("null", "json_schema", {"type": "null"}, 8),
    SpecCase("type_union_nullable", "json_schema", {"type": ["string", "null"], "maxLength": 8}, 24),
    SpecCase("all_of_merge", "json_schema", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}, 48),
    SpecCase("additional_properties_typed", "json_schema", {
        "type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}, 48),
    SpecCase("pattern_properties", "json_schema", {
        "type": "object", "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer"}},
        "additionalProperties": False, "maxProperties": 2}, 48),
    SpecCase("min_properties", "json_schema", {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "minProperties": 1, "additionalProperties": False}, 32),
    SpecCase("nested_label_record", "json_schema", {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "evidence": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
            "meta": {"type": "object", "properties": {"lang": {"type": "string", "pattern": "^[a-z]{2}$"}},
                     "required": ["lang"], "additionalProperties": False},
        },
        "required": ["label", "confidence", "meta"], "additionalProperties": False}, 128),
    SpecCase("integer_multiple_of", "json_schema", {"type": "integer", "multipleOf": 5, "minimum": 0,
                                                     "maximum": 100}, 16),
    SpecCase("any_json_value", "json_schema", {}, 64),
    SpecCase("open_object", "json_schema", {"type": "object", "maxProperties": 1,
                                            "additionalProperties": {"type": "boolean"}}, 32),
    SpecCase("annotations_ignored", "json_schema", {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "T", "description": "d",
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 5, "examples": ["abc"],
                                               "default": "x"}},
        "required": ["q"], "additionalProperties": False}, 32),
)

REGEX_CASES: tuple[SpecCase, ...] = (
    SpecCase("regex_digits", "regex", r"[0-9]{3,5}", 16),
    SpecCase("regex_alternation", "regex", r"(yes|no|maybe)", 8),
    SpecCase("regex_phone", "regex", r"\(\d{3}\) \d{3}-\d{4}", 24),
    SpecCase("regex_iso_date", "regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", 24),
    SpecCase("regex_identifier", "regex", r"[a-z_][a-z0-9_]{0,7}", 16),
    SpecCase("regex_hex_color", "regex", r"#[0-9a-fA-F]{6}", 16),
    SpecCase("regex_word_list", "regex", r"[a-z]+( [a-z]+){0,3}\.", 48),
)

CHOICE_CASES: tuple[SpecCase, ...] = (
    SpecCase("choice_sentiment", "choice", ["positive", "negative", "neutral"], 8),
    SpecCase("choice_regex_metachars", "choice", ["a.b", "c|d", "(x)", "1+1=2?", "[y]*", "^$\\"], 8),
    SpecCase("choice_quotes_unicode", "choice", ['say "hi"', "café", "naïve – ok", "tab\there"], 16),
    SpecCase("choice_shared_prefix", "choice", ["y", "yes", "yes please"], 8),
)

ALL_CASES: tuple[SpecCase, ...] = JSON_SCHEMA_CASES + REGEX_CASES + CHOICE_CASES

REJECTED_CASES: tuple[RejectedCase, ...] = (
    RejectedCase("unique_items", "json_schema", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    RejectedCase("not_keyword", "json_schema", {"not": {"type": "string"}}, "not"),
    RejectedCase("if_then", "json_schema", {"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    RejectedCase("contains", "json_schema", {"type": "array", "contains": {"type": "integer"}}, "contains"),
    RejectedCase("dependent_required", "json_schema",
                 {"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    RejectedCase("property_names", "json_schema",
                 {"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    RejectedCase("unevaluated_properties", "json_schema",
                 {"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    RejectedCase("one_of_overlapping", "json_schema",
                 {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    RejectedCase("invalid_type_name", "json_schema", {"type": "strin"}, "strin"),
    RejectedCase("invalid_required_not_list", "json_schema",
                 {"type": "object", "required": "name"}, "required"),
    RejectedCase("invalid_minimum_type", "json_schema", {"type": "integer", "minimum": "3"}, "minimum"),
    RejectedCase("dangling_ref", "json_schema", {"$ref": "#/$defs/missing"}, "$defs/missing"),
    RejectedCase("lookahead_pattern", "json_schema", {"type": "string", "pattern": "(?=a)b"}, "pattern"),
    RejectedCase("unsatisfiable_bounds", "json_schema", {"type": "integer", "minimum": 5, "maximum": 1},
                 "json_schema"),
    RejectedCase("not_json_serializable", "json_schema", {"enum": [{1, 2}]}, "not representable as JSON"),
    RejectedCase("nan_in_schema", "json_schema", {"const": float("nan")}, "not representable as JSON"),
    RejectedCase("regex_unbalanced", "regex", "(ab", "regex"),
    RejectedCase("regex_lookbehind", "regex", "(?<=a)b", "regex"),
    RejectedCase("regex_word_boundary", "regex", r"\bfoo\b", "regex"),
)


def case_params_kwargs(case: SpecCase | RejectedCase) -> dict[str, Any]:
    """The SamplingParams keyword argument that carries `case` (json_schema=..., regex=... or choice=...)."""
    return {case.kind: case.spec}
