"""The key plan of a JSON Schema: which values' states state_key.StateKey abstracts, and how.

Read from the schema as compiled (after normalize.py): the top value and the values of objects and arrays
the plan reads (plain `type: object` with `properties`, `type: array` with one `items`; no anyOf/oneOf/
allOf/$ref/type lists on the way, property names literal and distinct), so no union of the grammar can
depend on what is abstracted. Leaves: a free string (FreeString: `type: string` with at most
`minLength`/`maxLength`: only its character count is kept), a number class (NumberNode, number_key.py),
or None (verbatim). The argument for each is in state_key.py and number_key.py.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.engine.structured.number_key import NumberNode, number_node

_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly"})
_ROOT_ONLY = frozenset({"$schema", "$defs", "definitions"})  # $defs only serve $ref, which stays verbatim
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"}) | _ANNOTATIONS
_ARRAY_KEYS = frozenset({"type", "items", "minItems", "maxItems"}) | _ANNOTATIONS
_FREE_KEYS = frozenset({"type", "minLength", "maxLength"}) | _ANNOTATIONS


class FreeString:
    """A string value whose content only counts (see the module docstring)."""

    __slots__ = ("min_len", "max_len")

    def __init__(self, min_len: int, max_len: int | None) -> None:
        self.min_len = min_len
        self.max_len = max_len


class ObjectNode:
    """An object with literal, known property names; values of other names are kept verbatim."""

    __slots__ = ("props",)

    def __init__(self, props: dict[bytes, Any]) -> None:
        self.props = props


class ArrayNode:
    """An array whose items all have one node."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = items


# A node is FreeString, NumberNode (number_key.py), ObjectNode, ArrayNode or None (verbatim: every byte of
# the value is in the key).


def _quoted_name(name: str) -> bytes:
    """The bytes llguidance forces for a property name between its quotes (serde_json's escaping)."""
    out = []
    for ch in name:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20:
            return b""  # control characters: escaped differently by different encoders; never matched
        else:
            out.append(ch)
    return "".join(out).encode("utf-8")


def _node(schema: Any, root: bool = False) -> Any:
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - (_ROOT_ONLY if root else frozenset())
    kind = schema.get("type")
    if kind == "string" and keys <= _FREE_KEYS:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            return FreeString(lo, hi)
        return None
    if kind == "object" and keys <= _OBJECT_KEYS and schema.get("additionalProperties", True) is not None:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            return None
        out = {}
        for name, sub in props.items():
            quoted = _quoted_name(name)
            if quoted:
                out[quoted] = _node(sub)
        return ObjectNode(out)
    if kind == "array" and keys <= _ARRAY_KEYS:
        return ArrayNode(_node(schema.get("items")))
    if kind in ("number", "integer"):
        return number_node({k: v for k, v in schema.items() if k in keys})
    return None


def _abstracts(node: Any) -> bool:
    """Whether the key of some state under `node` is not its bytes (a free string or a number class)."""
    if isinstance(node, (FreeString, NumberNode)):
        return True
    if isinstance(node, ObjectNode):
        return any(_abstracts(n) for n in node.props.values())
    if isinstance(node, ArrayNode):
        return _abstracts(node.items)
    return False


def plan_of(schema: Any) -> Any:
    """The key plan of a (prepared) JSON Schema: its root node, or None when nothing in it is abstracted
    (no free string, no number class: the token-history cache then stays in charge)."""
    try:
        root = _node(schema, root=True)
    except RecursionError:
        return None
    return root if _abstracts(root) else None


def char_counts(token_bytes: list[bytes | None]) -> list[int]:
    """Per token id: its characters when it is only free-string text (no `"`, `\\`, controls, complete
    UTF-8), else -1. Lets `StateKey.feed` count such a token inside a free string without a byte loop."""
    out = []
    special = re.compile(rb'["\\\x00-\x1f\x7f]')
    for b in token_bytes:
        if not b or special.search(b):
            out.append(-1)
            continue
        try:
            out.append(len(b.decode("utf-8")))
        except UnicodeDecodeError:
            out.append(-1)
    return out
