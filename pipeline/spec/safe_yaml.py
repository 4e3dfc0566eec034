"""Load a YAML job spec so that a hostile or broken document cannot hurt the process.

``yaml.safe_load`` is safe against code execution but not against resource exhaustion or surprising
values: a 1 KB "billion laughs" document expands to 10^9 list items, ``[[[[...`` ten thousand deep
overflows the composer's recursion, duplicate keys are silently merged, ``on:`` becomes ``True:``,
``.nan`` slips past numeric range checks, ``2024-01-01`` becomes a ``datetime.date`` that JSON cannot
carry, and ``!!float "x"`` raises a bare ``ValueError`` with a traceback.

:func:`load_spec_text` instead drives the PyYAML parser (libyaml's C parser when present) event by event
and builds the plain Python value itself, iteratively, checking every limit as each event arrives, so a
limit is hit before any oversized object exists:

* the raw input is size-checked and its encoding verified before it is parsed;
* nesting depth is counted per event (and per alias, which grafts a whole subtree), never by recursion;
* every node counts towards ``max_nodes`` and every alias counts as the full size of the subtree its
  anchor names; the size of each anchored subtree is memoised when the subtree closes, so the check at
  each alias is O(1) and a bomb is refused at the first alias that overshoots, before anything is copied;
* an alias to an anchor that is still open (``&a [*a]``) is refused as recursive.

The result is a tree of ``dict``/``list``/``str``/``int``/``float``/``bool``/``None`` only, with no
shared sub-objects (each alias is copied; the copies are bounded by ``max_alias_expansion``), so callers
may mutate it and serialise it to JSON freely.

Decisions, where YAML 1.1 (and so ``yaml.safe_load``) would do something else:

* implicit timestamps (``seed: 2024-01-01``) are returned as the original string, since jobs carry
  JSON-compatible values only;
* explicit tags are refused, every one of them, including the harmless ``!!str``: quoting does the same;
* ``.nan``/``.inf`` in any letter case, and floats that overflow to infinity (``1.0e+999``), are refused;
* numbers longer than 1,000 characters are refused (Python's int parsing is super-linear in the digits);
* mapping keys must be strings: ``1:``, ``on:``, ``~:`` and complex keys are refused, as are aliases used
  as keys and duplicate keys (including a second ``<<``);
* duplicate anchors are refused (as ``yaml.safe_load`` does); merge keys ``<<: *base`` work as in
  ``yaml.safe_load``;
* a top-level ``<<`` or ``=`` used as a plain *value* is returned as that string (``safe_load`` fails).

Layout: this module is the public face (load_spec_text, parse_override, SpecSyntaxError, short); the
event builder lives in yaml_builder.py, decoding and message helpers in yaml_common.py. spec/load.py
uses it for spec files and --set values, so every spec deepinfer reads goes through these limits.
"""

from __future__ import annotations

from typing import Any

import yaml
from deepinfer.pipeline.spec.yaml_builder import _Builder
from deepinfer.pipeline.spec.yaml_common import SpecSyntaxError, _decode, _one_line, short

__all__ = ["SpecSyntaxError", "load_spec_text", "parse_override", "short"]

# The C parser is ~10x faster; both produce the same events. Only the parser is used: nodes and values
# are built here, so neither PyYAML's recursive composer nor its constructors ever see hostile input.
_Loader: Any = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _load(data: bytes | str, source: str, *, max_bytes: int, max_depth: int, max_nodes: int,
          max_alias_expansion: int, max_scalar_chars: int, top: str, key: str = "") -> object:
    text = _decode(data, source, max_bytes)
    builder = _Builder(source, max_depth=max_depth, max_nodes=max_nodes,
                       max_alias_expansion=max_alias_expansion, max_scalar_chars=max_scalar_chars,
                       top=top, key=key)
    loader = _Loader(text)
    try:
        builder.run(loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = _one_line(exc.problem or "invalid YAML")
        if exc.context:
            problem = f"{_one_line(exc.context)}: {problem}"
        if mark is None:
            raise SpecSyntaxError(f"{source}: YAML syntax error: {problem}") from None
        raise builder.fail_at(mark, f"YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:  # ReaderError and the like: no mark; the character check catches most
        raise SpecSyntaxError(f"{source}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:  # not expected (nothing here recurses on input depth); never a traceback
        raise SpecSyntaxError(f"{source}: nesting too deep to read") from None
    finally:
        loader.dispose()
    return builder.root if builder.has_root else None


def load_spec_text(data: bytes | str, source: str = "<spec>", *, max_bytes: int = 1_000_000,
                   max_depth: int = 64, max_nodes: int = 100_000, max_alias_expansion: int = 10_000,
                   max_scalar_chars: int = 100_000) -> object:
    """Parse one YAML document safely, or raise SpecSyntaxError.

    `data` is the raw file (bytes, decoded as UTF-8; a UTF-8 BOM is fine) or already-decoded text;
    `source` names it in messages ("spec.yaml: sampling.temperature: NaN ..."). The document must be a
    single YAML mapping with string keys; the result is a JSON-compatible tree (dict/list/str/int/float/
    bool/None) with no shared sub-objects. Limits: `max_bytes` of input, `max_depth` nested collections
    (aliases included), `max_nodes` values after alias expansion, `max_alias_expansion` values copied
    through aliases in all, `max_scalar_chars` characters per scalar. Timestamps stay strings.
    """
    value = _load(data, source, max_bytes=max_bytes, max_depth=max_depth, max_nodes=max_nodes,
                  max_alias_expansion=max_alias_expansion, max_scalar_chars=max_scalar_chars, top="mapping")
    if value is None:  # no document, only comments, or a bare `---` / `~`
        raise SpecSyntaxError(f"{source} is empty: a spec is a YAML mapping of sections (name:, model:, ...)")
    if not isinstance(value, dict):
        kind = {bool: "boolean", int: "number", float: "number", str: "string"}.get(type(value), "scalar")
        raise SpecSyntaxError(f"{source}: the top level of a spec must be a mapping of sections "
                              f"(key: value), not a {kind} ({short(value)})", "line 1, column 1")
    return value


def parse_override(text: str, key: str) -> object:
    """Parse the VALUE of a CLI `--set KEY=VALUE` as a YAML scalar or flow collection (`7`, `0.5`, `true`,
    `s3://b/x`, `[a, b]`, `{k: v}`), with load_spec_text's rules (no tags, no NaN, string keys, limits).

    A blank value gives "" (what `--set output.path=` has always meant). A value that YAML would read as a
    block mapping or list (`Answer: yes`, `- a`) is refused, since the user almost surely meant a string:
    the message says to quote it. Errors are SpecSyntaxError naming `--set KEY`."""
    if not text.strip():
        return ""
    return _load(text, f"--set {key}", max_bytes=100_000, max_depth=64, max_nodes=100_000,
                 max_alias_expansion=10_000, max_scalar_chars=100_000, top="flow", key=key)
