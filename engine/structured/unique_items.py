"""`uniqueItems: true` over a finite set of item values, rewritten into a schema the grammar library enforces.

llguidance (like every token-mask grammar) cannot enforce uniqueItems in general: "no element equal to an
earlier one" is not context-free over unbounded values. When the items are drawn from a finite set — an
`enum`, a `const`, `type: boolean` / `null`, as in the `{"type": "array", "items": {"enum": [...]},
"uniqueItems": true, "maxItems": 3}` tag lists users write — the valid arrays can be listed, so the array
node becomes an `anyOf` of exact arrays (`prefixItems` of `const`s, `items: false`):

* every ordering of every allowed subset (each permutation of each length in [minItems, maxItems]) when there
  are at most MAX_ALTERNATIVES of them, so the model may list the items in any order;
* otherwise every subset once, its items in the order the schema lists them (still exactly the arrays that
  are valid, up to order), when those are at most MAX_ALTERNATIVES;
* otherwise the schema is refused with a message that says so (lower maxItems or the number of values).

A node is rewritten only when nothing else on it could interact with the listing (no prefixItems, contains,
anyOf/oneOf/allOf, $ref, unevaluatedItems, ...). Anything else keeps its `uniqueItems` and the grammar
library refuses it as before. `uniqueItems: false` is a no-op and is dropped.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import jsonschema

# The largest anyOf the rewrite emits. Right after "[" every alternative is alive in one row of
# llguidance's Earley parser, which allows 2000 items per row (max_items_in_row; past it the matcher fails
# mid-generation, not at compile time), so the listing stays well below that. Compiling 1500 alternatives
# takes ~0.2 s (cached per schema) and masks stay below 0.1 ms per token on the test tokenizer. The cap is
# per array: a schema offering several large listed arrays as alternatives at one position (an anyOf of
# them) can still pass the row limit together; the matcher then errs and the request ends invalid.
MAX_ALTERNATIVES = 1500

# Keys that may sit beside the array keywords without changing which arrays are valid.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id", "$defs", "definitions"})
_ARRAY_KEYS = frozenset({"type", "items", "uniqueItems", "minItems", "maxItems"})
# Keys an item schema may hold for its values to be listed: the values are checked against it as a whole.
_ITEM_KEYS = frozenset({"enum", "const", "type"}) | _ANNOTATIONS


def _finite_values(items: Any) -> list[Any] | None:
    """The distinct values `items` allows, in schema order, or None when they are not a finite list."""
    if not isinstance(items, dict) or not set(items) <= _ITEM_KEYS:
        return None
    if "const" in items:
        candidates = [items["const"]]
    elif "enum" in items:
        candidates = list(items["enum"])
    elif items.get("type") == "boolean":
        candidates = [False, True]
    elif items.get("type") == "null":
        candidates = [None]
    else:
        return None
    check = jsonschema.Draft202012Validator(items)
    seen: set[str] = set()
    values: list[Any] = []
    for v in candidates:
        key = _equality_key(v)
        if key not in seen and check.is_valid(v):
            seen.add(key)
            values.append(v)
    return values


def _resolve_local_ref(items: Any, root: Any) -> Any:
    """`items` with local `$ref`s ("#/$defs/Tag", as pydantic writes enums) followed; unresolvable -> None."""
    for _ in range(8):   # a chain longer than this (or a cycle) is not a finite set worth listing
        if not (isinstance(items, dict) and "$ref" in items):
            return items
        ref = items["$ref"]
        if set(items) - {"$ref"} - _ANNOTATIONS or not isinstance(ref, str) or not ref.startswith("#"):
            return None
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        items = target
    return None


def _equality_key(value: Any) -> str:
    """JSON Schema equality: 1 == 1.0, but true != 1 (json.dumps keeps booleans apart)."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def _is_array_type(node: dict[str, Any]) -> bool:
    t = node.get("type", "array")
    return t == "array" or t == ["array"]


def _exact_array(values: tuple[Any, ...]) -> dict[str, Any]:
    if not values:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "prefixItems": [{"const": v} for v in values], "items": False,
            "minItems": len(values)}


def rewrite_unique_items(node: dict[str, Any], where: str, root: Any = None) -> dict[str, Any]:
    """`node` (a schema object, modified in place) with a finite-valued `uniqueItems: true` rewritten;
    `root` (the whole schema) resolves a local `$ref` in `items`.

    Raises ValueError when the items are finite but the valid arrays are too many to list, or none exists.
    """
    unique = node.get("uniqueItems")
    if unique is False:
        del node["uniqueItems"]
        return node
    if unique is not True or not set(node) <= _ARRAY_KEYS | _ANNOTATIONS or not _is_array_type(node):
        return node
    values = _finite_values(_resolve_local_ref(node.get("items"), root if root is not None else node))
    if values is None:
        return node
    n = len(values)
    lo = node.get("minItems", 0)
    hi = min(node.get("maxItems", n), n)
    if lo > hi:
        raise ValueError(f"json_schema: uniqueItems at {where}: no array of {lo}+ distinct items exists, the "
                         f"items allow only {n} distinct values")
    lengths = range(lo, hi + 1)
    orderings = sum(math.perm(n, k) for k in lengths)
    subsets = sum(math.comb(n, k) for k in lengths)
    if orderings <= MAX_ALTERNATIVES:
        arrays = [p for k in lengths for p in itertools.permutations(values, k)]
    elif subsets <= MAX_ALTERNATIVES:
        arrays = [c for k in lengths for c in itertools.combinations(values, k)]
    else:
        raise ValueError(
            f"json_schema: uniqueItems at {where}: {n} item values with {lo}..{hi} items make {subsets} "
            f"distinct sets, more than the {MAX_ALTERNATIVES} the grammar can list; lower maxItems or the "
            "number of values, or drop uniqueItems and deduplicate after generation"
        )
    for key in _ARRAY_KEYS:
        node.pop(key, None)
    node["anyOf"] = [_exact_array(a) for a in arrays]
    return node
