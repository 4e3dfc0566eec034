"""The event-driven builder behind safe_yaml.load_spec_text: turns PyYAML parser events into a plain
JSON-compatible tree, iteratively, checking every limit (depth, nodes, alias expansion, tags, keys,
non-finite numbers) as each event arrives. See safe_yaml.py for the rules and why.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from deepinfer.pipeline.spec.yaml_common import (
    _OPEN,
    SpecSyntaxError,
    _Anchor,
    _copy_tree,
    _Frame,
    _name,
    _one_line,
    _path_text,
    short,
)

_TAG_PREFIX = "tag:yaml.org,2002:"
_STR = _TAG_PREFIX + "str"
_NULL = _TAG_PREFIX + "null"
_BOOL = _TAG_PREFIX + "bool"
_INT = _TAG_PREFIX + "int"
_FLOAT = _TAG_PREFIX + "float"
_TIMESTAMP = _TAG_PREFIX + "timestamp"
_MERGE = _TAG_PREFIX + "merge"
_VALUE = _TAG_PREFIX + "value"

# Snapshot of the implicit resolvers of YAML's safe schema, taken at import so that another library
# calling yaml.add_implicit_resolver later cannot change what a spec means.
_IMPLICIT: dict[str | None, list[tuple[str, re.Pattern[str]]]] = {
    first: list(pairs) for first, pairs in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
}
# SafeConstructor's int/float/bool conversions are pure functions of node.value; reusing them keeps
# numbers identical to yaml.safe_load (0x1f, 0o-style 017, 1_000, sexagesimal 1:30, ...).
_CONSTRUCTOR = yaml.constructor.SafeConstructor()

_NON_FINITE_WORD = re.compile(r"[-+]?\.(?:nan|inf)", re.IGNORECASE)
_MAX_NUMBER_CHARS = 1000

_KIND_OF_TAG = {_NULL: "null", _BOOL: "a boolean", _INT: "an integer", _FLOAT: "a float"}


class _Builder:
    """Builds the value of one document from parser events, enforcing every limit as it goes."""

    def __init__(self, source: str, *, max_depth: int, max_nodes: int, max_alias_expansion: int,
                 max_scalar_chars: int, top: str, key: str = "") -> None:
        self.source = source
        self.key = key  # the --set KEY whose value this is (top == "flow")
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.max_alias_expansion = max_alias_expansion
        self.max_scalar_chars = max_scalar_chars
        self.top = top  # "mapping": a spec file; "flow": a --set value (scalar or flow collection)
        self.stack: list[_Frame] = []
        self.anchors: dict[str, _Anchor] = {}
        self.nodes = 0
        self.alias_nodes = 0
        self.documents = 0
        self.root: object = None
        self.has_root = False

    # -- error reporting ---------------------------------------------------------------------------------

    def fail_at(self, mark: Any, problem: str) -> SpecSyntaxError:
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        if self.top == "flow":  # a --set value is one short line: "column 5 of the value" is enough
            where = f"column {mark.column + 1}" if mark.line == 0 else where
            return SpecSyntaxError(f"{self.source}: {problem} ({where} of the value)", where)
        return SpecSyntaxError(f"{self.source}: {where}: {problem}", where)

    def fail_value(self, mark: Any, path: tuple[str | int, ...], problem: str) -> SpecSyntaxError:
        """A bad value: named by its key path (the location most users think in), line as a hint."""
        if self.top == "flow":  # "--set sampling.temperature: NaN is not allowed", path from the --set key
            where = _path_text(path, prefix=self.key)
            return SpecSyntaxError(f"--set {where}: {problem}", where)
        if not path:
            return self.fail_at(mark, problem)
        where = _path_text(path)
        return SpecSyntaxError(
            f"{self.source}: {where}: {problem} (line {mark.line + 1}, column {mark.column + 1})", where
        )

    # -- structure -------------------------------------------------------------------------------------

    def child_path(self) -> tuple[str | int, ...]:
        if not self.stack:
            return ()
        parent = self.stack[-1]
        return (*parent.path, parent.key) if parent.is_map else (*parent.path, len(parent.value))

    def count(self, n: int, mark: Any, alias: str | None = None) -> None:
        self.nodes += n
        if alias is not None:
            self.alias_nodes += n
            if self.alias_nodes > self.max_alias_expansion:
                raise self.fail_at(
                    mark,
                    f"alias *{alias} (anchor &{alias}) pushes the values copied through aliases past "
                    f"{self.max_alias_expansion:,} (an alias bomb?); use fewer or smaller aliases",
                )
        if self.nodes > self.max_nodes:
            what = f"alias *{alias} (anchor &{alias}) expands" if alias else "it expands"
            raise self.fail_at(
                mark, f"the document has more than {self.max_nodes:,} values ({what} past the limit)"
            )

    def check_tag(self, event: Any, path: tuple[str | int, ...]) -> None:
        tag = event.tag
        if tag is None:
            return
        shown = "!!" + tag[len(_TAG_PREFIX):] if tag.startswith(_TAG_PREFIX) else tag
        raise self.fail_value(
            event.start_mark, path,
            f"explicit YAML tag {short(shown)} is not allowed; write the value plainly "
            "(quote it for a string)",
        )

    def awaiting_key(self) -> bool:
        return bool(self.stack) and self.stack[-1].is_map and not self.stack[-1].has_key

    def start_collection(self, event: Any, is_map: bool) -> None:
        mark = event.start_mark
        if self.awaiting_key():
            raise self.fail_at(mark, "a mapping key must be a plain string, not a "
                                     f"{'mapping' if is_map else 'list'} (complex keys are not allowed)")
        if event.tag is not None:
            self.check_tag(event, self.child_path())
        if not self.stack:
            if self.top == "mapping" and not is_map:
                raise self.fail_at(mark, "the top level of a spec must be a mapping of sections "
                                         "(key: value), not a list")
            if self.top == "flow" and not event.flow_style:
                kind = "mapping" if is_map else "list"
                raise self.fail_at(mark, f"the value reads as a YAML block {kind}; quote it for a string, "
                                         "or use flow style ({a: 1} or [1, 2])")
        depth = len(self.stack) + 1
        if depth > self.max_depth:
            raise self.fail_value(mark, self.child_path(), f"nesting too deep: more than {self.max_depth} "
                                  f"levels (reached depth {depth})")
        self.count(1, mark)
        anchor = event.anchor
        if anchor is not None:
            self.define_anchor(anchor, _OPEN, mark)
        self.stack.append(_Frame(is_map, self.stack[-1] if self.stack else None, anchor, mark.line + 1))

    def end_collection(self, event: Any) -> None:
        frame = self.stack.pop()
        value = frame.value
        if frame.merges:
            # YAML merge keys, with yaml.safe_load's precedence: keys written in the mapping win over
            # merged ones; among `<<: [*a, *b]` the earlier mapping wins; several `<<` apply in order.
            merged: dict[str, Any] = {}
            for source, _mark in frame.merges:
                for part in (reversed(source) if isinstance(source, list) else (source,)):
                    merged.update(part)  # type: ignore[call-overload]
            merged.update(value)
            value = merged
        if frame.anchor is not None:
            self.anchors[frame.anchor] = _Anchor(value, frame.size, frame.height, frame.line)
        self.add(value, frame.size, frame.height, event.start_mark)

    def define_anchor(self, name: str, anchor: _Anchor, mark: Any) -> None:
        first = self.anchors.get(name)
        if first is not None:
            again = "while it is still open" if first is _OPEN else f"first defined on line {first.line}"
            raise self.fail_at(mark, f"anchor &{_name(name)} is defined twice ({again})")
        self.anchors[name] = anchor

    def add(self, value: object, size: int, height: int, mark: Any) -> None:
        """Attach a finished node to its parent (or make it the document root)."""
        if not self.stack:
            self.root, self.has_root = value, True
            return
        parent = self.stack[-1]
        parent.size += size
        parent.height = max(parent.height, height + 1)
        if not parent.is_map:
            parent.value.append(value)
        else:
            parent.has_key = False
            if parent.merging:
                parent.merging = False
                if not (isinstance(value, dict)
                        or (isinstance(value, list) and all(isinstance(v, dict) for v in value))):
                    raise self.fail_value(mark, (*parent.path, "<<"),
                                          "a merge key (<<) needs a mapping or a list of mappings")
                parent.merges.append((value, mark))
            else:
                parent.value[parent.key] = value

    def add_key(self, key: str, mark: Any, merge: bool) -> None:
        parent = self.stack[-1]
        first = parent.key_lines.get(key)
        if first is not None:
            raise self.fail_at(mark, f"duplicate key {short(key)} in "
                                     f"{_path_text(parent.path) or 'the top level'} (first on line {first})")
        parent.key_lines[key] = mark.line + 1
        parent.size += 1  # a key is a node too: an alias of this mapping copies it
        parent.key, parent.has_key, parent.merging = key, True, merge

    # -- scalars and aliases -----------------------------------------------------------------------------

    def scalar(self, event: Any) -> None:
        # The hot path (one call per scalar, up to max_nodes of them): the key path is built only when
        # something is wrong, and the common cases are inlined rather than going through add().
        text: str = event.value
        stack = self.stack
        parent = stack[-1] if stack else None
        is_key = parent is not None and parent.is_map and not parent.has_key
        if len(text) > self.max_scalar_chars or event.tag is not None:
            path = parent.path if is_key and parent is not None else self.child_path()
            if len(text) > self.max_scalar_chars:
                raise self.fail_value(event.start_mark, path, f"a value of {len(text):,} characters is too "
                                      f"long (limit {self.max_scalar_chars:,}): {short(text)}")
            self.check_tag(event, path)
        self.nodes += 1
        if self.nodes > self.max_nodes:
            self.count(0, event.start_mark)  # raises
        tag = _STR
        plain = event.implicit[0]
        if plain:  # plain (unquoted, untagged): YAML's safe schema decides the type
            for resolved, regexp in _IMPLICIT.get(text[:1], ()):
                if regexp.match(text):
                    tag = resolved
                    break
        if is_key:
            mark = event.start_mark
            if tag in _KIND_OF_TAG:
                what = "empty (null)" if tag == _NULL else f"read as {_KIND_OF_TAG[tag]} by YAML"
                hint = f"; quote it ({short(text)}) if it is meant as a name" if text else ""
                raise self.fail_at(mark, f"mapping key {short(text)} is {what}; keys must be strings{hint}")
            if event.anchor is not None:
                self.define_anchor(event.anchor, _Anchor(text, 1, 0, mark.line + 1), mark)
            self.add_key(text, mark, tag == _MERGE)
            return
        if plain and text[:1] in ("+", "-", ".") and _NON_FINITE_WORD.fullmatch(text):
            word = "NaN" if text.lower().endswith("nan") else "infinity"
            raise self.fail_value(event.start_mark, self.child_path(),
                                  f"{word} is not allowed (found {text}); numbers must be finite")
        value = text if tag == _STR else self.convert(text, tag, event.start_mark)
        if event.anchor is not None:
            mark = event.start_mark
            self.define_anchor(event.anchor, _Anchor(value, 1, 0, mark.line + 1), mark)
        if parent is None or parent.merging:
            self.add(value, 1, 0, event.start_mark)
        elif parent.is_map:
            parent.size += 1
            parent.has_key = False
            parent.value[parent.key] = value
        else:
            parent.size += 1
            parent.value.append(value)

    def convert(self, text: str, tag: str, mark: Any) -> object:
        """The value of a plain scalar that YAML resolved to `tag` (anything but str)."""
        if tag == _NULL:
            return None
        if tag == _BOOL:
            return _CONSTRUCTOR.bool_values[text.lower()]
        if tag == _INT or tag == _FLOAT:
            if len(text) > _MAX_NUMBER_CHARS:
                raise self.fail_value(mark, self.child_path(), f"a number of {len(text):,} characters is too "
                                      f"long (limit {_MAX_NUMBER_CHARS:,}); quote it for a string")
            number: int | float
            try:
                # Fast paths for the usual spellings; the rest (0x1f, 017, 1_000, 1:30, ...) goes through
                # SafeConstructor so that the value is exactly what yaml.safe_load gives.
                if tag == _INT:
                    if text[0] in "123456789" and text.isdigit():
                        number = int(text)
                    else:
                        number = _CONSTRUCTOR.construct_yaml_int(yaml.ScalarNode(tag, text))
                elif "_" not in text and ":" not in text:
                    number = float(text)
                else:
                    number = _CONSTRUCTOR.construct_yaml_float(yaml.ScalarNode(tag, text))
            except (ValueError, OverflowError) as exc:  # the regexes admit it; be safe anyway
                raise self.fail_value(
                    mark, self.child_path(), f"cannot read {short(text)} as a number ({_one_line(exc)})"
                ) from None
            if isinstance(number, float) and number - number != 0.0:  # inf or nan, e.g. 1.0e+999
                raise self.fail_value(mark, self.child_path(), f"{short(text)} is not a finite number")
            return number
        # The implicit types kept as text: timestamps (JSON has no dates), and "<<"/"=" used as values,
        # which yaml.safe_load cannot construct at all.
        return text

    def alias(self, event: Any) -> None:
        mark = event.start_mark
        name: str = event.anchor
        anchor = self.anchors.get(name)
        if anchor is None:
            raise self.fail_at(mark, f"alias *{_name(name)} refers to no anchor (define &name first)")
        if anchor is _OPEN:
            raise self.fail_at(mark, f"recursive alias: *{_name(name)} is inside the very node its "
                                     "anchor names, which would be infinitely deep")
        if self.awaiting_key():
            raise self.fail_at(mark, f"an alias (*{_name(name)}) cannot be a mapping key; "
                                     "keys must be plain strings")
        depth = len(self.stack) + anchor.height
        if depth > self.max_depth:
            raise self.fail_value(mark, self.child_path(),
                                  f"nesting too deep: alias *{_name(name)} makes it {depth} levels "
                                  f"(limit {self.max_depth})")
        self.count(anchor.size, mark, alias=_name(name))
        self.add(_copy_tree(anchor.value), anchor.size, anchor.height, mark)

    # -- the event loop ------------------------------------------------------------------------------------

    def run(self, loader: Any) -> None:
        handlers = {
            yaml.ScalarEvent: self.scalar,
            yaml.AliasEvent: self.alias,
            yaml.MappingStartEvent: lambda e: self.start_collection(e, True),
            yaml.SequenceStartEvent: lambda e: self.start_collection(e, False),
            yaml.MappingEndEvent: self.end_collection,
            yaml.SequenceEndEvent: self.end_collection,
        }
        scalar = self.scalar
        get_event = loader.get_event
        while True:
            event = get_event()
            kind = type(event)
            if kind is yaml.ScalarEvent:
                scalar(event)
                continue
            handler = handlers.get(kind)
            if handler is not None:
                handler(event)
            elif isinstance(event, yaml.DocumentStartEvent):
                self.documents += 1
                if self.documents > 1:
                    what = "a spec" if self.top == "mapping" else "the value"
                    raise self.fail_at(event.start_mark, f"{what} must be one YAML document, but a second "
                                                         "one starts here (remove the extra '---')")
            elif isinstance(event, yaml.StreamEndEvent):
                return


