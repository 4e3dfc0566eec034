"""Independent check of a finished output against its constraint (jsonschema / Python `re` / membership).

This does not use the grammar library: tests and the pipeline use it to confirm that what the grammar
allowed is really valid.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema


def output_satisfies(kind: str, spec: Any, text: str) -> bool:
    """True when `text` is valid for the constraint: JSON that validates against the schema (formats
    checked with the Draft 2020-12 format checker), a full match of the regex, or one of the choices."""
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    if kind != "json_schema":
        raise ValueError(f"kind={kind!r}: expected 'json_schema', 'regex' or 'choice'")
    try:
        value = json.loads(text)
    except ValueError:
        return False
    cls = jsonschema.Draft202012Validator
    return cls(spec, format_checker=cls.FORMAT_CHECKER).is_valid(value)
