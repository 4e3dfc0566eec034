"""Validation of a job-spec document against schemas/job.schema.json, with defaults filled in.

The JSON Schema is the single source of truth: this module only loads it, fills in `default`s while
validating, and turns jsonschema's errors into one line per problem that names the field path
(`sampling.temperature: -1 is less than the minimum of 0 (expected: Softmax temperature; ...)`).
Kept free of torch/ray imports: `deepinfer-job validate` must stay fast.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from typing import Any

from deepinfer.pipeline.errors import SpecError
from deepinfer.pipeline.spec.bounds import coerce_integers, structure_problems
from deepinfer.pipeline.spec.yaml_common import short

MAX_LINE_CHARS = 400


@cache
def load_schema(name: str = "job.schema.json") -> dict:
    """One of the JSON Schemas shipped in deepinfer.schemas (parsed once per process; callers copy)."""
    text = resources.files("deepinfer.schemas").joinpath(name).read_text(encoding="utf-8")
    return json.loads(text)


def _validator_with_defaults():
    from jsonschema import Draft202012Validator, validators

    validate_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema):
        # Insert defaults before descending, so a defaulted object (e.g. runtime: {}) gets its own defaults.
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": properties_with_defaults})


def _field(path: list[Any]) -> str:
    return ".".join(str(p) for p in path) if path else "(top level)"


def _subschema(schema: dict, path: list[str]) -> dict | None:
    node: Any = schema
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get("properties", {}).get(key)
    return node if isinstance(node, dict) else None


def _format_error(error, schema: dict) -> list[str]:
    path = list(error.absolute_path)
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in error.instance]
        lines = []
        for name in missing:
            sub = _subschema(schema, [*map(str, path), name]) or {}
            hint = f" (expected: {sub['description']})" if sub.get("description") else ""
            lines.append(f"{_field([*path, name])}: required field is missing{hint}")
        return lines
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in error.schema.get("properties", {}))
        lines = [f"{_field([*path, short(k, 40) if len(k) > 40 else k])}: unknown field (allowed here: "
                 f"{', '.join(allowed)})" for k in unknown[:10]]
        if len(unknown) > 10:
            lines.append(f"{_field(path)}: ... and {len(unknown) - 10:,} more unknown fields")
        return lines
    if error.validator in ("anyOf", "oneOf") and error.context:
        return _alternatives_error(error, schema)
    hint = ""
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    if description is None and path:
        sub = _subschema(schema, [str(p) for p in path])
        description = (sub or {}).get("description")
    if description:
        hint = f" (expected: {description})"
    return [_bounded(f"{_field(path)}: {_message(error)}{hint}")]


def _alternatives_error(error, schema: dict) -> list[str]:
    """A value that fits none of a field's forms: what the form of its own kind objects to, rather than
    jsonschema's bare 'is not valid under any of the given schemas' (a metric name that is no metric: the
    names there are; a typo inside the object form: that key, with the keys allowed)."""
    from jsonschema.exceptions import best_match

    kinds = {dict: "object", list: "array"}
    kind = kinds.get(type(error.instance))
    branches: dict[int, list] = {}
    for sub in error.context:
        branches.setdefault(sub.schema_path[0], []).append(sub)
    forms = error.validator_value
    same_kind = [i for i in branches if kind is not None and isinstance(forms[i], dict)
                 and forms[i].get("type") == kind]
    chosen = branches[same_kind[0]] if same_kind else list(error.context)
    lines = _format_error(best_match(chosen), schema)
    objects = [f for f in forms if isinstance(f, dict) and f.get("type") == "object"]
    if kind is None and objects:
        lines = [line + " (or the object form {" + ", ".join(objects[0].get("properties", {})) + "})"
                 for line in lines]
    return [_bounded(line) for line in lines]


def _message(error) -> str:
    """jsonschema's message with the offending value quoted by a short prefix only (its message embeds
    the whole repr, which for a 200 KB string would be a 200 KB line)."""
    message = error.message
    if len(message) > 200:
        text = repr(error.instance)
        if text in message:
            message = message.replace(text, short(error.instance), 1)
    return message


def _bounded(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…"


def validate_document(doc: Any) -> dict:
    """Validate a job-spec document and return a copy with every default filled in.

    Raises SpecError listing every problem, each naming its field path.
    """
    schema = load_schema()
    if not isinstance(doc, dict):
        raise SpecError([f"(top level): the spec must be a mapping of sections, got {type(doc).__name__}"])
    # Bounds, keys and finiteness first, without jsonschema: a document that fails them could make it
    # slow (uniqueItems is quadratic on unsortable lists) or crash its error formatting.
    problems = structure_problems(doc, schema)
    if problems:
        raise SpecError(problems)
    filled = copy.deepcopy(doc)
    validator = _validator_with_defaults()(schema)
    errors = sorted(validator.iter_errors(filled), key=lambda e: [str(p) for p in e.absolute_path])
    for error in errors:
        for line in _format_error(error, schema):
            if line not in problems:
                problems.append(line)
    if problems:
        raise SpecError(problems)
    coerce_integers(filled, schema)
    return filled
