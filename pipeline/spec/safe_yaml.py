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
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# The C parser is ~10x faster; both produce the same events. Only the parser is used: nodes and values
# are built here, so neither PyYAML's recursive composer nor its constructors ever see hostile input.
_Loader: Any = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader

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

# Characters YAML forbids (same set as PyYAML's Reader.NON_PRINTABLE), plus U+FEFF after the start,
# which libyaml rejects without a usable location; checked up front so the report has line and column.
_NON_PRINTABLE = re.compile(
    "[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]"
)
# Every letter case of the YAML special floats, signed or not: YAML 1.1 resolves only .nan/.NaN/.NAN
# (and the same for inf), so ".Nan" would silently become a string; a plain ".Nan" is never meant as text.
_NON_FINITE_WORD = re.compile(r"[-+]?\.(?:nan|inf)", re.IGNORECASE)
_MAX_NUMBER_CHARS = 1000
_SHORT_CHARS = 60

_KIND_OF_TAG = {_NULL: "null", _BOOL: "a boolean", _INT: "an integer", _FLOAT: "a float"}


class SpecSyntaxError(ValueError):
    """A spec document that cannot be loaded safely; .where is a short location ('line 3, column 5' or a
    dotted key path), str(e) is a one-line message a user can act on."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


def short(value: object, limit: int = _SHORT_CHARS) -> str:
    """Quote `value` for an error message: at most `limit` characters of it, cut with "…", and escaped
    (repr) so that a newline or control character in hostile input cannot break the one-line message."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return repr(text)


def _human_size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:,} bytes"


def _size_message(source: str, size: int, limit: int) -> str:
    got, cap = _human_size(size), _human_size(limit)
    if got == cap:  # "1 MB; limited to 1 MB" reads as a bug; say the exact byte counts instead
        got, cap = f"{size:,} bytes", f"{limit:,} bytes"
    return f"{source} is {got}; specs are limited to {cap}"


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of character `index` of `text`."""
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


def _guess_wide_encoding(head: bytes) -> str | None:
    """Name the UTF-16/UTF-32 flavour that `head` (the first bytes of a file) looks like, or None.

    Specs are mostly ASCII, so a wide encoding shows as NUL bytes at fixed positions: UTF-16LE puts them
    at odd offsets, UTF-16BE at even ones, UTF-32 at both (three of every four bytes)."""
    for bom, name in (
        (b"\xff\xfe\x00\x00", "UTF-32, little-endian"),
        (b"\x00\x00\xfe\xff", "UTF-32, big-endian"),
        (b"\xff\xfe", "UTF-16, little-endian"),
        (b"\xfe\xff", "UTF-16, big-endian"),
    ):
        if head.startswith(bom):
            return name
    if b"\x00" not in head:
        return None
    even, odd = head[0::2], head[1::2]
    even_nul = even.count(0) / max(len(even), 1)
    odd_nul = odd.count(0) / max(len(odd), 1)
    if even_nul > 0.25 and odd_nul > 0.25:
        return "UTF-32, little-endian" if odd_nul > even_nul else "UTF-32, big-endian"
    if odd_nul > 0.25:
        return "UTF-16, little-endian"
    if even_nul > 0.25:
        return "UTF-16, big-endian"
    return None  # a stray NUL: decodes as UTF-8 and is reported by the character check with its line


def _decode(data: bytes | str, source: str, max_bytes: int) -> str:
    """Size-check and decode the raw input; returns text without a leading BOM."""
    if isinstance(data, str):
        # A str longer than max_bytes characters is over the limit whatever its encoding; only a shorter
        # one is worth encoding to count its bytes (surrogatepass: lone surrogates are reported below).
        if len(data) > max_bytes:
            raise SpecSyntaxError(_size_message(source, len(data), max_bytes))
        size = len(data) if data.isascii() else len(data.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise SpecSyntaxError(_size_message(source, size, max_bytes))
        text = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if len(raw) > max_bytes:
            raise SpecSyntaxError(_size_message(source, len(raw), max_bytes))
        wide = _guess_wide_encoding(raw[:1024])
        if wide is not None:
            raise SpecSyntaxError(f"{source} is not UTF-8 (looks like {wide}); save it as UTF-8", "offset 0")
        skip = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        try:
            text = raw[skip:].decode("utf-8")
        except UnicodeDecodeError as exc:
            offset = exc.start + skip
            # Everything before the bad byte is valid UTF-8, so its decoded prefix gives line and column.
            prefix = raw[skip:offset].decode("utf-8")
            line, col = _line_col(prefix, len(prefix))
            where = f"line {line}, column {col}"
            raise SpecSyntaxError(
                f"{source} is not UTF-8: invalid UTF-8 byte 0x{raw[offset]:02x} at offset {offset} ({where})",
                where,
            ) from None
        return _check_characters(text, source)
    else:
        raise TypeError(f"load_spec_text needs bytes or str, not {type(data).__name__}")
    return _check_characters(text[1:] if text.startswith("\ufeff") else text, source)


def _check_characters(text: str, source: str) -> str:
    bad = _NON_PRINTABLE.search(text)
    if bad is not None:
        line, col = _line_col(text, bad.start())
        where = f"line {line}, column {col}"
        char = ord(bad.group())
        what = "a NUL byte" if char == 0 else f"character U+{char:04X}"
        if char == 0xFEFF:
            what = "a byte-order mark (U+FEFF) after the start of the text"
        if 0xD800 <= char <= 0xDFFF:
            what = f"an unpaired surrogate U+{char:04X} (not valid Unicode)"
        raise SpecSyntaxError(f"{source}: {where}: {what} is not allowed in YAML", where)
    return text


def _name(anchor: str) -> str:
    """An anchor name for a message (names are short in practice; a hostile one is cut)."""
    return anchor if len(anchor) <= 40 else anchor[:39] + "…"


def _one_line(text: object, limit: int = 200) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _path_text(path: tuple[str | int, ...], prefix: str = "") -> str:
    """`sampling.stop[2]`-style path; a path 10,000 deep is cut in the middle to stay one short line."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            # Keys are quoted only when they would make the dotted path ambiguous or run long.
            plain = part and len(part) <= 40 and all(c.isalnum() or c in "_-" for c in part)
            parts.append("." + (part if plain else short(part, 40)))
    if len(parts) > 8:
        parts = [*parts[:4], "…", *parts[-3:]]
    text = prefix + "".join(parts)
    return text[1:] if text.startswith(".") else text


class _Anchor:
    """What an anchor names, once its subtree has closed: the value, its node count and its height."""

    __slots__ = ("value", "size", "height", "line")

    def __init__(self, value: object, size: int, height: int, line: int) -> None:
        self.value, self.size, self.height, self.line = value, size, height, line


_OPEN = _Anchor(None, 0, 0, 0)  # placeholder while an anchored collection is still being read


class _Frame:
    """One collection being built: a list, or a dict plus the key waiting for its value."""

    __slots__ = ("value", "is_map", "parent", "slot", "size", "height", "anchor", "key", "has_key", "merging",
                 "key_lines", "merges", "line")

    def __init__(self, is_map: bool, parent: _Frame | None, anchor: str | None, line: int) -> None:
        self.is_map = is_map
        self.value: Any = {} if is_map else []
        # Where this collection sits in its parent, kept instead of a full key path: building a path
        # tuple per collection would cost O(depth) each; paths are only needed for error messages.
        self.parent = parent
        self.slot: str | int = "" if parent is None else parent.key if parent.is_map else len(parent.value)
        self.size = 1  # nodes in this subtree, aliases counted at full expanded size
        self.height = 1  # collections on the longest downward path, this one included
        self.anchor = anchor
        self.key: str = ""
        self.has_key = False  # a mapping alternates key, value: True while the value is awaited
        self.merging = False  # the awaited value belongs to a `<<` merge key
        self.key_lines: dict[str, int] = {}
        self.merges: list[tuple[object, Any]] = []  # (value, mark) of each `<<: ...`
        self.line = line

    @property
    def path(self) -> tuple[str | int, ...]:
        """Key path of this collection from the document root (walked upwards, never recursively)."""
        parts: list[str | int] = []
        frame: _Frame | None = self
        while frame is not None and frame.parent is not None:
            parts.append(frame.slot)
            frame = frame.parent
        return tuple(reversed(parts))


def _copy_tree(value: object) -> object:
    """Copy a dict/list tree iteratively (aliases become independent copies, like JSON would give)."""
    if not isinstance(value, (dict, list)):
        return value
    root: Any = {} if isinstance(value, dict) else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            if isinstance(v, (dict, list)):
                v_copy: Any = {} if isinstance(v, dict) else []
                stack.append((v, v_copy))
                v = v_copy
            if isinstance(dst, dict):
                dst[k] = v
            else:
                dst.append(v)
    return root


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
                    raise self.fail_at(event.start_mark, "a spec must be one YAML document, but a second one "
                                                         "starts here (remove the extra '---')")
            elif isinstance(event, yaml.StreamEndEvent):
                return


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
