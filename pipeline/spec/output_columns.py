"""output_schema -> checks and typed output columns.

The top-level properties of an object output_schema become output columns whose Arrow type follows the
property's JSON Schema type: string -> string, integer -> int64, number -> float64, boolean -> bool, an
array of one of those -> list<...>. Everything else (objects, mixed types, $ref, anyOf, nested arrays) is
stored as compact JSON text, so the column type never depends on the data seen (deterministic file bytes).
"""

from __future__ import annotations

import json
from typing import Any

_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SCALARS = {"string": "string", "integer": "int64", "number": "float64", "boolean": "bool"}


def _kind_of_values(values: list[Any]) -> str | None:
    if values and all(isinstance(v, str) for v in values):
        return "string"
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int64"
    if values and all(isinstance(v, bool) for v in values):
        return "bool"
    return None


def scalar_kind(sub: Any) -> str | None:
    """The scalar Arrow kind a property schema always yields ('string', 'int64', ...), or None."""
    if not isinstance(sub, dict):
        return None
    if "enum" in sub and "type" not in sub:
        return _kind_of_values(list(sub["enum"]))
    if "const" in sub and "type" not in sub:
        return _kind_of_values([sub["const"]])
    kind = sub.get("type")
    if isinstance(kind, list):
        non_null = [k for k in kind if k != "null"]
        kind = non_null[0] if len(non_null) == 1 else None
    if not isinstance(kind, str) or any(k in sub for k in ("anyOf", "oneOf", "allOf", "$ref")):
        return None
    return _SCALARS.get(kind)


def column_kinds(schema: dict | None) -> list[tuple[str, str]]:
    """[(property name, kind)] for the typed columns; kind is a scalar kind, 'list<kind>' or 'json'."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return []
    out = []
    for name, sub in schema["properties"].items():
        kind = scalar_kind(sub)
        if kind is None and isinstance(sub, dict) and sub.get("type") in ("array", ["array", "null"]):
            item = scalar_kind(sub.get("items"))
            kind = f"list<{item}>" if item else None
        out.append((name, kind or "json"))
    return out


def arrow_type(kind: str):
    """The pyarrow type of a column kind from `column_kinds`."""
    import pyarrow as pa

    scalars = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
               "json": pa.string()}
    if kind.startswith("list<"):
        return pa.list_(scalars[kind[5:-1]])
    return scalars[kind]


def column_value(kind: str, value: Any) -> Any:
    """Convert one parsed JSON value to what the column of `kind` stores (None stays None)."""
    if value is None:
        return None
    if kind == "json":
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if kind == "float64":
        return float(value)
    return value


def schema_problems(schema: Any, taken: set[str], enforce_all: bool = True) -> list[str]:
    """Problems with an output_schema: not a valid JSON Schema, unsupported by the grammar backend (with
    `enforce_all` False, output_schema_mode: validate, only what even its enforceable part cannot fix),
    or a top-level property that clashes with a column the pipeline already writes."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(p) for p in exc.absolute_path)
        return [f"output_schema{'.' + where if where else ''}: not a valid JSON Schema: {exc.message}"]
    problems = [
        f"output_schema.properties.{name}: clashes with output column {name!r} (rename the property)"
        for name, _ in column_kinds(schema) if name in taken
    ]
    if enforce_all:
        problems += [p + " (or set output_schema_mode: validate to constrain by the enforceable part and "
                     "validate the rest after generation)" for p in grammar_problems(schema)]
    else:
        from deepinfer.pipeline.spec.enforceable import enforceable_part

        problems += enforceable_part(schema)[2]
    return problems


def grammar_problems(schema: dict) -> list[str]:
    """Problems the structured-output backend reports for `schema` (empty list when it can enforce it).

    Runs the engine's torch-free schema preparation (deepinfer.engine.structured.normalize) and asks
    llguidance, the grammar library behind constrained decoding, whether it implements every keyword
    (it refuses e.g. uniqueItems or not). The engine checks again when it builds the grammar.
    """
    try:
        from deepinfer.engine.structured.normalize import prepare_json_schema
    except ImportError:
        prepare_json_schema = None
    prepared = schema
    if prepare_json_schema is not None:
        try:
            prepared = prepare_json_schema(schema)
        except ValueError as exc:
            return [f"output_schema: {exc}"]
    try:
        import llguidance
    except ImportError:
        return []
    if prepared is False:
        return ["output_schema: the schema `false` accepts no value at all"]
    try:
        # The same compact-JSON options as the engine's backend (engine/structured/llguidance_backend.py,
        # not imported here because it needs torch).
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {} if prepared is True else prepared, overrides=_COMPACT_JSON)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        problem = str(exc)
    if problem:
        return [f"output_schema: not supported by constrained decoding: {problem.strip()}"]
    return []
