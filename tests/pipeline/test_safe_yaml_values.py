"""pipeline/spec/safe_yaml.py: good specs load exactly as yaml.safe_load would (minus the refusals), --set
values parse, and fuzzed documents either load as plain JSON-compatible trees or are refused cleanly.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from tests.support.safe_yaml_harness import (
    _REPO,
    BILLION_LAUGHS,
    SpecSyntaxError,
    _SafeLoader,
    _Timer,
    load_spec_text,
    parse_override,
)

GOOD_SPEC = """\
# A realistic job spec: nested mappings, lists, block scalars, unicode, and anchors used modestly.
name: review-labeling-ü
model:
  name: demo
  dtype: float32
input:
  path: data/reviews.jsonl
  format: jsonl
  id_column: review_id
defaults: &sampling_defaults
  temperature: 0.7
  top_p: 0.95
  max_tokens: 48
prompt:
  mode: chat
  system: "Réponds en JSON — 日本語もOK 🙂"
  template: |
    Product: {{ product }}
    Review: {{ review }}
    What is the sentiment?
  folded: >
    one
    two
sampling:
  <<: *sampling_defaults
  max_tokens: 64
  seed: 1234
  stop: ["\\n", "</s>", 'single ''quoted''']
output_schema:
  type: object
  properties:
    sentiment: {enum: [positive, negative, mixed]}
    score: {type: number, minimum: -1.5e+3, maximum: 1_000}
  required: [sentiment]
  additionalProperties: false
output:
  path: ../out/labeling
  format: parquet
  keep_columns: &cols [product, rating]
  also_keep: *cols
runtime:
  rows_per_part: 100
  batch_size: 0x40
  sort_window: 300
  max_error_fraction: 0.0
  enabled: yes
  note: ~
  empty:
  octal: 010
  sexagesimal: 1:30
"""


def _repo_job_specs() -> list[Path]:
    return sorted((_REPO / "jobs").glob("*.yaml")) if (_REPO / "jobs").is_dir() else []


@pytest.mark.parametrize(
    "text",
    [
        GOOD_SPEC,
        GOOD_SPEC.replace("\n", "\r\n"),
        "a: 1\n",
        "key with spaces: 'quoted: yes'\nurl: http://host:80/a#frag\nratio: 3:2 is text\n",
        "'1': quoted int key\n\"true\": quoted bool key\n'null': x\n",
        "x: {a: [1, 2.5, -3, true, null, '', \"s\"]}\n",
        "nested:\n  - name: a\n    args: [1, 2]\n  - name: b\n    args: {k: v}\n",
        "base: &b {x: 1, y: 2}\nmulti: {<<: [*b, {y: 3, z: 4}], w: 5}\nempty_merge: {<<: [], a: 1}\n",
        "deep: " + "[" * 60 + "1" + "]" * 60 + "\n",
        "---\na: 1\n...\n",
        "%YAML 1.1\n---\na: 1\n",
    ],
    ids=["job-spec", "job-spec-crlf", "minimal", "colons", "quoted-keys", "flow", "list-of-maps", "merges",
         "depth-61", "explicit-markers", "yaml-directive"],
)
def test_good_spec_matches_safe_load(text: str) -> None:
    with _Timer() as timer:
        value = load_spec_text(text, "good.yaml")
    timer.check()
    assert value == yaml.load(text, Loader=_SafeLoader)
    assert value == load_spec_text(text.encode("utf-8"))
    assert value == load_spec_text(b"\xef\xbb\xbf" + text.encode("utf-8"))  # a UTF-8 BOM is fine
    _assert_plain(value)


@pytest.mark.parametrize("path", _repo_job_specs(), ids=lambda p: p.name)
def test_shipped_job_specs_load_like_safe_load(path: Path) -> None:
    data = path.read_bytes()
    assert load_spec_text(data, path.name) == yaml.safe_load(data)


def test_good_spec_details() -> None:
    value = load_spec_text(GOOD_SPEC)
    assert value["sampling"] == {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64, "seed": 1234,
                                 "stop": ["\n", "</s>", "single 'quoted'"]}
    assert value["runtime"]["batch_size"] == 64 and value["runtime"]["octal"] == 8
    assert value["runtime"]["enabled"] is True and value["runtime"]["empty"] is None
    assert value["prompt"]["system"] == "Réponds en JSON — 日本語もOK 🙂"
    # Aliases are independent copies: editing one place (a --set override) does not edit the other.
    value["output"]["also_keep"].append("extra")
    assert value["output"]["keep_columns"] == ["product", "rating"]


def test_timestamps_stay_strings() -> None:
    text = "seed: 2024-01-01\nwhen: 2001-12-14t21:59:43.10-05:00\n2024-06-30: a date-like key\n"
    value = load_spec_text(text)
    assert value == {"seed": "2024-01-01", "when": "2001-12-14t21:59:43.10-05:00",
                     "2024-06-30": "a date-like key"}
    json.dumps(value)


def test_merge_and_equals_values_are_strings() -> None:
    # yaml.safe_load cannot construct these (ConstructorError); they are just text here.
    assert load_spec_text("a: <<\nb: =\n") == {"a": "<<", "b": "="}


OVERRIDES_OK = [
    ("7", 7), ("0.5", 0.5), ("-3", -3), ("true", True), ("null", None), ("", ""), ("   ", ""),
    ("s3://bucket/run-2/", "s3://bucket/run-2/"), ("[a, b]", ["a", "b"]),
    ("{k: v, n: [1]}", {"k": "v", "n": [1]}), ("'a: b'", "a: b"), ('"quoted"', "quoted"),
    ("2024-01-01", "2024-01-01"), ("out/eval/seed-0", "out/eval/seed-0"),
    ("héllo wörld", "héllo wörld"),
]


@pytest.mark.parametrize(("text", "expected"), OVERRIDES_OK, ids=[repr(t) for t, _ in OVERRIDES_OK])
def test_parse_override_values(text: str, expected: object) -> None:
    assert parse_override(text, "sampling.seed") == expected


OVERRIDES_BAD = [
    (".nan", "--set sampling.temperature: NaN is not allowed"),
    ("-.Inf", "--set sampling.temperature: infinity is not allowed"),
    ("{t: .nan}", "--set sampling.temperature.t: NaN is not allowed"),
    ("[1, .inf]", "--set sampling.temperature[1]: infinity"),
    ("!!float 1", "--set sampling.temperature: explicit YAML tag '!!float'"),
    ("!!python/object/apply:os.system [ls]", "--set sampling.temperature: explicit YAML tag"),
    ("Answer: yes", "--set sampling.temperature: the value reads as a YAML block mapping; quote it"),
    ("- a", "--set sampling.temperature: the value reads as a YAML block list"),
    ("[1, 2", "--set sampling.temperature: YAML syntax error"),
    ("{1: a}", "--set sampling.temperature: mapping key '1' is read as an integer"),
    ("{a: 1, a: 2}", "--set sampling.temperature: duplicate key 'a'"),
    ("&a [*a]", "--set sampling.temperature: recursive alias"),
    ("[" * 5000, "--set sampling.temperature"),
    ("a\n---\nb", "--set sampling.temperature: the value must be one YAML document"),
    ("x" * 100_001, "--set sampling.temperature is 100,001 bytes; --set values are limited to 100,000 bytes"),
    ("bad\x00byte", "--set sampling.temperature"),
]


@pytest.mark.parametrize(("text", "fragment"), OVERRIDES_BAD, ids=[repr(t[:20]) for t, _ in OVERRIDES_BAD])
def test_parse_override_refusals(text: str, fragment: str) -> None:
    with _Timer() as timer, pytest.raises(SpecSyntaxError) as info:
        parse_override(text, "sampling.temperature")
    timer.check()
    assert str(info.value).startswith(fragment), str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def _assert_plain(value: object) -> None:
    """JSON-compatible only: dict with str keys, list, str, int, float (finite), bool, None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            assert all(type(k) is str for k in item), item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            assert item is None or type(item) in (str, int, float, bool), type(item)
            assert not isinstance(item, float) or math.isfinite(item)
    json.dumps(value, allow_nan=False)


FUZZ_SAMPLE = (GOOD_SPEC + "extra:\n  list: [1, 2, {a: b}]\n  block:\n    - x\n    - y: z\n").encode("utf-8")
FUZZ_INSERTS = [
    b"!!python/object:os.system ", b"!!float ", b"!custom ", b"!!binary ", b"!!set ", b"! ", b"&z ", b"*z ",
    b"*sampling_defaults ", b"&a [*a]", b"<<: *cols\n", b".nan", b"-.Inf", b"---\n", b"? [k]\n: v\n", b"\t",
    b"'", b'"', b"{", b"}", b"[", b"]", b": ", b"- ", b"\n  ", b"#", b"|\n", b"%TAG ! tag:x,2000:\n",
    b"\x00", b"\xff", b"\xc3", b"\xef\xbb\xbf", "日本".encode(), b"2024-01-01", b"1: ", b"on: ", b"~: ",
]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(8)
        pos = rng.randrange(len(buf) + 1)
        lines = bytes(buf).split(b"\n")
        if choice == 0 and buf:  # random byte flips, mostly to ASCII so that most reach the parser
            for _ in range(rng.randint(1, 8)):
                byte = rng.randrange(256) if rng.random() < 0.2 else rng.randrange(128)
                buf[rng.randrange(len(buf))] = byte
        elif choice == 1:  # truncation
            del buf[pos:]
        elif choice == 2 and lines:  # a duplicated line (often a duplicate key)
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            buf = bytearray(b"\n".join(lines))
        elif choice == 3:  # an inserted tag, alias, anchor or special token
            buf[pos:pos] = rng.choice(FUZZ_INSERTS)
        elif choice == 4:  # deep brackets, balanced or not
            n = rng.choice([10, 63, 64, 65, 500, 10_000])
            opener, closer = rng.choice([(b"[", b"]"), (b"{a: ", b"}"), (b"- ", b"")])
            buf[pos:pos] = opener * n + (closer * n if rng.random() < 0.5 else b"")
        elif choice == 5 and lines:  # a deleted line
            del lines[rng.randrange(len(lines))]
            buf = bytearray(b"\n".join(lines))
        elif choice == 6 and len(lines) > 1:  # re-indented line
            i = rng.randrange(len(lines))
            lines[i] = b" " * rng.randint(0, 6) + lines[i].lstrip()
            buf = bytearray(b"\n".join(lines))
        else:  # a bomb appended, or the anchors reused many times
            buf += rng.choice([BILLION_LAUGHS.encode(), b"more: [" + b"*cols, " * 3000 + b"]\n"])
    return bytes(buf)


def _fuzz_cases() -> list[bytes]:
    rng = random.Random(20240601)
    return [_mutate(rng, FUZZ_SAMPLE) for _ in range(300)]


def _has_dates(value: object) -> bool:
    import datetime

    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (datetime.date, datetime.datetime)):
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


@pytest.mark.parametrize("data", _fuzz_cases(), ids=[f"mutation-{i}" for i in range(300)])
def test_fuzzed_spec_loads_or_is_refused(data: bytes) -> None:
    value: object = None
    with _Timer() as timer:
        try:
            value = load_spec_text(data, "fuzz.yaml")
        except SpecSyntaxError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 400, str(exc)
    timer.check()
    if value is None:
        return
    _assert_plain(value)
    # What loads must mean what yaml.safe_load says it means (bar timestamps, which stay strings here).
    # Only reached for documents that passed every limit, so safe_load is safe to run on them.
    try:
        expected = yaml.load(data, Loader=_SafeLoader)
    except yaml.YAMLError:
        return
    if not _has_dates(expected):
        assert value == expected

