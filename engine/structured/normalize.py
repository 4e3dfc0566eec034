"""Checks and rewrites applied to user constraints before the grammar library sees them.

* JSON Schemas are checked with jsonschema's Draft 2020-12 meta-schema (a malformed schema is a user error
  reported with its location), then rewritten so that what the grammar allows is exactly valid for the
  jsonschema validator that checks outputs:
  - `\\d`, `\\D`, `\\w`, `\\W` in `pattern`s become ASCII classes. ECMA-262 (JSON Schema's regex dialect)
    defines them as ASCII; the grammar library reads them as Unicode and may emit digits newer than the
    validator's Unicode tables.
  - `format: date | time | date-time` become exact `pattern`s (month lengths, leap years, no leap second,
    year 0000 excluded) — the grammar library's own formats are looser than RFC 3339 as the jsonschema
    format checker applies it.
* Regexes get the same ASCII class rewrite (an ASCII digit is a digit for Python's `re` as well).
* Choices become a Lark grammar of JSON-quoted string literals (quotes, backslashes, control characters and
  non-ASCII text are escaped by `json.dumps`, so no choice can inject grammar syntax).

* `uniqueItems: true` over items from a finite set (enum, const, boolean) becomes an `anyOf` of the valid
  arrays (unique_items.py); other `uniqueItems` are left for the grammar library to refuse.

Only the keywords that hold subschemas are walked, so `const`/`enum`/`default` values are never rewritten.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
from deepinfer.engine.structured.unique_items import rewrite_unique_items

# Keywords whose value is one subschema / a list of subschemas / a name -> subschema map (Draft 2020-12,
# plus draft-7 spellings the grammar library also reads).
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MANY = ("prefixItems", "allOf", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_OFFSET}$",
    "date-time": f"^{_DATE}T{_TIME}{_OFFSET}$",
}

_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """Rewrite `\\d \\D \\w \\W` to ASCII classes, inside or outside brackets; everything else is kept."""
    out: list[str] = []
    in_class = False
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            e = regex[i + 1]
            cls = _ASCII_CLASSES.get(e.lower())
            if cls is None:
                out.append(regex[i:i + 2])
            elif e.islower():
                out.append(cls if in_class else f"[{cls}]")
            else:
                out.append(f"[^{cls}]")  # nested inside a class: a union, as the Rust regex dialect reads it
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def _rewrite_schema(node: Any, path: str = "", root: Any = None) -> Any:
    if not isinstance(node, dict):
        return node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            node[key] = _rewrite_schema(node[key], f"{path}/{key}", root)
    for key in _MANY:
        if isinstance(node.get(key), list):
            node[key] = [_rewrite_schema(s, f"{path}/{key}/{i}", root) for i, s in enumerate(node[key])]
    if isinstance(node.get("items"), list):
        node["items"] = [_rewrite_schema(s, f"{path}/items/{i}", root) for i, s in enumerate(node["items"])]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            node[key] = {name: _rewrite_schema(s, f"{path}/{key}/{name}", root)
                         for name, s in node[key].items()}
    if isinstance(node.get("pattern"), str):
        node["pattern"] = ascii_classes(node["pattern"])
    fmt = node.get("format")
    if fmt in FORMAT_PATTERNS:
        exact = FORMAT_PATTERNS[fmt]
        del node["format"]
        if "pattern" in node:
            node.setdefault("allOf", []).append({"pattern": exact})
        else:
            node["pattern"] = exact
    if "uniqueItems" in node:
        node = rewrite_unique_items(node, path or "the top level", root)
    return node


def _where(path: Any) -> str:
    parts = [str(p) for p in path]
    return "/" + "/".join(parts) if parts else "the top level"


def prepare_json_schema(schema: Any) -> Any:
    """Check `schema` against the Draft 2020-12 meta-schema and return the rewritten copy.

    Raises ValueError("json_schema: invalid schema at /path: ...") for a malformed schema.
    """
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema: expected an object (dict), got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"json_schema: invalid schema at {_where(e.absolute_path)}: {e.message}") from None
    schema = copy.deepcopy(schema)
    return _rewrite_schema(schema, "", schema)


def prepare_regex(regex: str) -> str:
    return ascii_classes(regex)


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices` (duplicates removed, order kept)."""
    unique = list(dict.fromkeys(choices))
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=True) for c in unique)
