"""Structural checks that run before JSON Schema validation, so a hostile document cannot hurt it.

jsonschema evaluates every keyword of every node: a 100,000-element list under ``uniqueItems`` of mixed
types is compared pairwise (quadratic), a mapping with integer keys makes error formatting sort mixed
types, and ``number`` accepts NaN and infinity, which every range check then lets through. This module
walks the document once, iteratively (no recursion on document depth), alongside the schema's
``properties``/``items``, and reports: non-string mapping keys, non-finite numbers, lists over
``maxItems``, strings over ``maxLength``, mappings over ``maxProperties``. Only a document that passes goes
on to jsonschema. Messages quote at most a short prefix of a bad value.

It also reads the schema's own annotations (``x-affects-output``) for the fingerprint, so which settings
may change between a run and its resume is declared once, in schemas/job.schema.json.
"""

from __future__ import annotations

import math
from typing import Any

from deepinfer.pipeline.spec.yaml_common import _path_text, short

MAX_PROBLEMS = 20


def _child_schema(schema: dict | None, key: str | int) -> dict | None:
    if not isinstance(schema, dict):
        return None
    if isinstance(key, int):
        items = schema.get("items")
        return items if isinstance(items, dict) else None
    sub = (schema.get("properties") or {}).get(key)
    return sub if isinstance(sub, dict) else None


def _where(path: tuple[str | int, ...]) -> str:
    return _path_text(path) or "(top level)"


def structure_problems(doc: Any, schema: dict) -> list[str]:
    """Problems found walking `doc` against `schema` (see the module docstring); at most MAX_PROBLEMS."""
    problems: list[str] = []
    stack: list[tuple[Any, dict | None, tuple[str | int, ...]]] = [(doc, schema, ())]
    while stack and len(problems) < MAX_PROBLEMS:
        value, sub, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{_where(path)}: {value!r} is not allowed; numbers must be finite")
        elif isinstance(value, str):
            limit = (sub or {}).get("maxLength")
            if isinstance(limit, int) and len(value) > limit:
                problems.append(f"{_where(path)}: a string of {len(value):,} characters is longer than the "
                                f"maximum of {limit:,} ({short(value)})")
        elif isinstance(value, list):
            limit = (sub or {}).get("maxItems")
            if isinstance(limit, int) and len(value) > limit:
                problems.append(f"{_where(path)}: a list of {len(value):,} items is longer than the maximum "
                                f"of {limit:,}")
                continue
            stack.extend((v, _child_schema(sub, i), (*path, i)) for i, v in enumerate(value))
        elif isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                problems.append(f"{_where(path)}: mapping key {short(bad[0])} is a {type(bad[0]).__name__}; "
                                "keys must be strings (quote it)")
                continue
            limit = (sub or {}).get("maxProperties")
            if isinstance(limit, int) and len(value) > limit:
                problems.append(f"{_where(path)}: {len(value):,} entries, more than the maximum of {limit:,}")
                continue
            stack.extend((v, _child_schema(sub, k), (*path, k)) for k, v in value.items())
    return sorted(problems)


def more_nodes_than(value: Any, limit: int) -> bool:
    """Whether `value` (a JSON-like tree) has more than `limit` nodes; stops counting at the limit."""
    stack, seen = [value], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def coerce_integers(doc: Any, schema: dict) -> None:
    """Turn integral floats (`batch_size: 64.0`, `1e3`) into ints where the schema says integer, in place.

    JSON Schema counts 64.0 as an integer, but Python's range() and the engine do not."""
    stack: list[tuple[Any, dict | None]] = [(doc, schema)]
    while stack:
        value, sub = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                child = _child_schema(sub, k)
                if isinstance(v, float) and _wants_integer(child) and v.is_integer():
                    value[k] = int(v)
                else:
                    stack.append((v, child))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                child = _child_schema(sub, i)
                if isinstance(v, float) and _wants_integer(child) and v.is_integer():
                    value[i] = int(v)
                else:
                    stack.append((v, child))


def _wants_integer(schema: dict | None) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds and "number" not in kinds


def keys_not_affecting_output(schema: dict, section: str) -> frozenset[str]:
    """Names of `section`'s properties annotated ``"x-affects-output": false`` in the schema."""
    props = ((schema.get("properties") or {}).get(section) or {}).get("properties") or {}
    return frozenset(name for name, sub in props.items()
                     if isinstance(sub, dict) and sub.get("x-affects-output") is False)
