"""Text-level pieces of the safe spec loader (safe_yaml.py): the error type, decoding and character checks,
short quoting of bad values for one-line messages, and the plain tree nodes the event builder fills.

Split from safe_yaml.py to keep each module small; stdlib only.
"""

from __future__ import annotations

import re
from typing import Any

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
    what = "--set values" if source.startswith("--set ") else "specs"
    return f"{source} is {got}; {what} are limited to {cap}"


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


