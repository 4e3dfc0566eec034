"""pipeline/spec/safe_yaml.py: hostile YAML specs are refused quickly with a one-line SpecSyntaxError naming
what is wrong (good specs and fuzzing: test_safe_yaml_values.py)."""


from __future__ import annotations

import pytest

from tests.support.safe_yaml_harness import (
    _SLOWDOWN,
    BILLION_LAUGHS,
    _bomb,
    _refused,
    load_spec_text,
    safe_yaml,
)

assert len(BILLION_LAUGHS) < 1024

HOSTILE: list[tuple[str, bytes | str, str]] = [
    # alias bombs, all under 1 KB
    ("billion-laughs", BILLION_LAUGHS, "alias *l"),
    ("list-bomb-7-levels", _bomb(7, 10, "list"), "alias *l"),
    ("dict-bomb-7-levels", _bomb(7, 10, "dict"), "alias *l"),
    ("block-list-bomb", _bomb(7, 8, "block"), "alias *l"),
    ("merge-key-bomb", _bomb(7, 8, "merge"), "alias *l"),
    ("recursive-alias-list", "a: &a [*a]\n", "recursive alias: *a"),
    ("recursive-alias-map", "a: &a {x: [1, {y: *a}]}\n", "recursive alias: *a"),
    ("undefined-alias", "a: *nowhere\n", "refers to no anchor"),
    ("duplicate-anchor", "a: &x 1\nb: &x 2\n", "anchor &x is defined twice"),
    # nesting
    ("depth-10000-flow-list", "k: " + "[" * 10_000 + "]" * 10_000 + "\n", "nesting too deep"),
    ("depth-10000-flow-map", "k: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n", "nesting too deep"),
    ("depth-10000-block-list", "k:\n  " + "- " * 10_000 + "x\n", "nesting too deep"),
    ("depth-200-block-map", "".join(" " * i + "a:\n" for i in range(200)) + " " * 200 + "x\n",
     "nesting too deep"),
    ("depth-unclosed-1MB", "k: " + "[" * 999_000, "nesting too deep"),
    ("top-level-depth-1MB", "[" * 999_000, "must be a mapping"),
    ("alias-adds-depth", "a: &d " + "[" * 40 + "1" + "]" * 40 + "\nb: " + "[" * 30 + "*d" + "]" * 30 + "\n",
     "alias *d makes it 71 levels"),
    # size and encoding
    ("2MB-bytes", b"a: " + b"x" * 2_000_000 + b"\n", "spec.yaml is 2 MB; specs are limited to 1 MB"),
    ("2MB-str", "a: " + "x" * 2_000_000 + "\n", "spec.yaml is 2 MB; specs are limited to 1 MB"),
    ("just-over-limit", b"a: " + b"x" * 999_998, "1,000,001 bytes; specs are limited to 1,000,000 bytes"),
    ("utf16-le-bom", "a: 1\n".encode("utf-16"), "is not UTF-8 (looks like UTF-16"),
    ("utf16-be-bom", b"\xfe\xff" + "a: 1\n".encode("utf-16-be"), "is not UTF-8 (looks like UTF-16"),
    ("utf16-le-no-bom", "name: job\n".encode("utf-16-le"), "is not UTF-8 (looks like UTF-16"),
    ("utf16-be-no-bom", "name: job\n".encode("utf-16-be"), "is not UTF-8 (looks like UTF-16"),
    ("utf32-le-bom", "a: 1\n".encode("utf-32"), "is not UTF-8 (looks like UTF-32"),
    ("utf32-be-no-bom", "a: 1\n".encode("utf-32-be"), "is not UTF-8 (looks like UTF-32"),
    ("invalid-utf8-ff", b"name: x\nb: \xff\n", "invalid UTF-8 byte 0xff at offset 11"),
    ("latin1-e-acute", "name: caf\xe9\n".encode("latin-1"), "invalid UTF-8 byte 0xe9 at offset 9"),
    ("truncated-utf8", b"a: \xe2\x82", "invalid UTF-8 byte 0xe2 at offset 3"),
    ("invalid-utf8-after-bom", b"\xef\xbb\xbfa: \xc0\xaf\n", "invalid UTF-8 byte 0xc0 at offset 6"),
    ("nul-byte", b"a: 1\nb: x\x00y\n", "NUL byte"),
    ("control-char", "a: bell\x07\n", "U+0007"),
    ("lone-surrogate-str", "a: \ud800\n", "unpaired surrogate"),
    # keys
    ("int-key", "1: x\n", "mapping key '1' is read as an integer"),
    ("float-key", "sampling:\n  0.5: x\n", "read as a float"),
    ("bool-key-true", "true: x\n", "read as a boolean"),
    ("bool-key-on", "on: push\n", "mapping key 'on' is read as a boolean"),
    ("null-key-tilde", "~: x\n", "is empty (null)"),
    ("null-key-word", "null: x\n", "is empty (null)"),
    ("empty-key", "? \n: x\n", "is empty (null)"),
    ("complex-key-explicit", "? [a]\n: b\n", "complex keys are not allowed"),
    ("complex-key-flow", "[a, b]: c\n", "complex keys are not allowed"),
    ("complex-key-map", "? {a: 1}\n: b\n", "complex keys are not allowed"),
    ("alias-key", "a: &k v\n*k : x\n", "cannot be a mapping key"),
    ("duplicate-key-top", "name: a\nmodel: {}\nname: b\n", "duplicate key 'name' in the top level"),
    ("duplicate-key-nested", "sampling:\n  seed: 1\n  seed: 2\n", "duplicate key 'seed' in sampling"),
    ("duplicate-key-flow", "x: {a: 1, a: 2}\n", "duplicate key 'a' in x"),
    ("duplicate-merge-key", "b: &b {x: 1}\nj: {<<: *b, <<: *b}\n", "duplicate key '<<'"),
    ("merge-of-scalar", "b: &b 1\nj: {<<: *b}\n", "merge key (<<) needs a mapping"),
    # tags
    ("tag-float", 'x: !!float "x"\n', "tag '!!float'"),
    ("tag-int", 'x: !!int "0x"\n', "tag '!!int'"),
    ("tag-python-object", "x: !!python/object:os.system 'ls'\n", "tag '!!python/object:os.system'"),
    ("tag-python-apply", "x: !!python/object/apply:os.system [ls]\n",
     "tag '!!python/object/apply:os.system'"),
    ("tag-custom", "x: !custom 1\n", "tag '!custom'"),
    ("tag-binary", "x: !!binary aGVsbG8=\n", "tag '!!binary'"),
    ("tag-timestamp", "x: !!timestamp 2024-01-01\n", "tag '!!timestamp'"),
    ("tag-set", "x: !!set {a, b}\n", "tag '!!set'"),
    ("tag-omap", "x: !!omap [a: 1]\n", "tag '!!omap'"),
    ("tag-str", "x: !!str 1\n", "tag '!!str'"),
    ("tag-non-specific", "x: ! 5\n", "tag '!'"),
    ("tag-verbatim", "x: !<tag:example.com,2000:thing> 5\n", "tag 'tag:example.com,2000:thing'"),
    ("tag-on-mapping", "x: !!map {a: 1}\n", "tag '!!map'"),
    ("tag-directive", "%TAG !e! tag:example.com,2000:\n---\nx: !e!foo 1\n", "tag 'tag:example.com,2000:foo'"),
    ("tag-on-key", "!!str a: 1\n", "tag '!!str'"),
    # non-finite numbers
    ("nan", "sampling:\n  temperature: .nan\n", "sampling.temperature: NaN is not allowed"),
    ("nan-caps", "sampling:\n  temperature: .NaN\n", "sampling.temperature: NaN is not allowed"),
    ("nan-odd-case", "sampling:\n  temperature: .nAn\n", "sampling.temperature: NaN is not allowed"),
    ("inf", "sampling:\n  top_p: .inf\n", "sampling.top_p: infinity is not allowed"),
    ("minus-inf", "sampling:\n  top_p: -.Inf\n", "sampling.top_p: infinity is not allowed"),
    ("plus-INF-in-list", "x: [1, +.INF]\n", "x[1]: infinity is not allowed"),
    ("float-overflow", "x: 1.0e+999\n", "x: '1.0e+999' is not a finite number"),
    ("huge-integer", "seed: " + "9" * 5000 + "\n", "a number of 5,000 characters is too long"),
    # long scalars
    ("long-plain-scalar", "a: " + "x" * 200_000 + "\n", "a value of 200,000 characters is too long"),
    ("long-quoted-scalar", 'a: "' + "y" * 150_000 + '"\n', "a value of 150,000 characters is too long"),
    ("long-block-scalar", "a: |\n" + ("  " + "z" * 99 + "\n") * 1500, "characters is too long"),
    ("long-key", "? " + "k" * 100_001 + "\n: 1\n", "characters is too long"),
    ("long-simple-key", "k" * 2000 + ": 1\n", "YAML syntax error"),  # YAML caps implicit keys at 1024
    # document shape
    ("two-documents", "a: 1\n---\nb: 2\n", "one YAML document"),
    ("two-markers", "---\na: 1\n---\na: 1\n", "one YAML document"),
    ("end-marker-then-document", "a: 1\n...\n---\nb: 2\n", "one YAML document"),
    ("empty", "", "spec.yaml is empty"),
    ("empty-bytes", b"", "spec.yaml is empty"),
    ("only-comments", "# a comment\n\n   \n", "spec.yaml is empty"),
    ("only-bom", b"\xef\xbb\xbf", "spec.yaml is empty"),
    ("bare-document-marker", "---\n", "spec.yaml is empty"),
    ("null-document", "~\n", "spec.yaml is empty"),
    ("top-level-list", "- a\n- b\n", "must be a mapping"),
    ("top-level-flow-list", "[a, b]\n", "must be a mapping"),
    ("top-level-string", "just some text\n", "must be a mapping"),
    ("top-level-number", "42\n", "must be a mapping"),
    # syntax errors
    ("unclosed-flow", "a: [1, 2\nb: 3\n", "line 2, column 2: YAML syntax error"),
    ("unclosed-quote", "a: 'open\n", "YAML syntax error"),
    ("tab-indent", "a:\n\tb: 1\n", "line 2, column 1: YAML syntax error"),
    ("bad-indent", "a:\n  b: 1\n c: 2\n", "YAML syntax error"),
    ("stray-colon", "a: b: c\n", "line 1, column 5: YAML syntax error"),
    ("bad-yaml-version", "%YAML 2.0\n---\na: 1\n", "YAML syntax error"),
]


@pytest.mark.parametrize(("data", "fragment"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_spec_is_refused(data: bytes | str, fragment: str) -> None:
    error = _refused(data)
    assert fragment in str(error), str(error)


def test_error_locations() -> None:
    assert _refused("sampling:\n  temperature: .nan\n").where == "sampling.temperature"
    assert _refused("a: 1\nb: {c: [1, !!binary eA==]}\n").where == "b.c[1]"
    assert _refused("a: 1\n2: x\n").where == "line 2, column 1"
    assert _refused(b"a: 1\nb: \xff\n").where == "line 2, column 4"
    deep = _refused("k: " + "[" * 10_000)
    assert deep.where.startswith("k[0][0][0]") and len(deep.where) < 60  # a cut path, not 10,000 levels


def test_bad_value_is_quoted_short() -> None:
    error = _refused("a: " + "Q" * 200_000 + "\n")
    assert "Q" * 59 in str(error) and "Q" * 61 not in str(error) and "…" in str(error)
    assert safe_yaml.short("x" * 100) == repr("x" * 59 + "…")
    assert safe_yaml.short("two\nlines") == repr("two\nlines")  # escaped, still one line


def test_alias_bombs_are_cut_by_max_nodes_too() -> None:
    """With the alias budget lifted, the total node count still stops a bomb, naming the anchor."""
    error = _refused(BILLION_LAUGHS, max_alias_expansion=10**12)
    assert "more than 100,000 values" in str(error) and "anchor &l" in str(error)


@pytest.mark.skipif(_SLOWDOWN > 1, reason="the pure-Python parser alone needs ~3 s CPU for 100,000 nodes")
def test_plain_size_is_cut_by_max_nodes() -> None:
    """The heaviest input the limits admit: 100,000 values read before the limit trips (~0.4 s CPU)."""
    error = _refused("k: [" + ", ".join(["1"] * 300_000) + "]\n")  # no aliases at all
    assert "more than 100,000 values" in str(error)


def test_limits_are_inclusive_and_configurable() -> None:
    ok = "k: " + "[" * 63 + "1" + "]" * 63 + "\n"  # the root mapping is level 1: 64 levels in all
    assert load_spec_text(ok)["k"] is not None
    assert "reached depth 65" in str(_refused("k: " + "[" * 64 + "1" + "]" * 64 + "\n"))
    assert "more than 3 levels" in str(_refused("a: {b: {c: {d: 1}}}\n", max_depth=3))
    assert load_spec_text("a: " + "x" * 100_000)["a"] == "x" * 100_000
    assert "too long" in str(_refused("a: xxxxx\n", max_scalar_chars=4))
    assert "limited to 10 bytes" in str(_refused("a: 12345678\n", max_bytes=10))
    modest = "base: &b [1, 2, 3]\nx: *b\ny: *b\n"  # 4 nodes per alias
    assert load_spec_text(modest, max_alias_expansion=8)["y"] == [1, 2, 3]
    assert "alias *b" in str(_refused(modest, max_alias_expansion=7))


