"""Specs cannot hurt the validator: a seeded fuzz over every field of the example specs in jobs/.

Each case mutates one field (or the file as a whole) of jobs/*.yaml — type swaps, unknown keys, integer
keys, explicit tags, alias bombs, deep nesting, NaN/inf, huge lists and strings, other encodings, huge
numbers, hostile templates and storage options — and runs `deepinfer-job validate` in-process. Every
case must exit 0 or 2 within 2 s, print no traceback, and keep its message short (a bad value is quoted
by a prefix only). Defects 4, 7, 8 and 10 of the hardening issue are each among the cases.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from deepinfer.pipeline.cli.main import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "jobs").glob("*.yaml"))
SEED = 20261201
CASES_PER_SPEC = 110
TIME_LIMIT_S = 2.0
RAW = "__RAW_VALUE__"

_BOMB = ("[&a [x, x, x, x, x, x, x, x, x, x], &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
         "&c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], "
         "&e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d], &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]]")
# Raw YAML snippets put in place of one value (flow style, so they fit anywhere).
RAW_VALUES = [
    ".nan", "-.inf", ".Inf", "1.0e+999", '!!float "x"', "!!python/object:os.system ls", "!!str 5",
    "{1: x}", "{~: x}", "{on: x}", "{[a]: b}", _BOMB, "&r [*r]", "*nowhere", "[" * 3000 + "]" * 3000,
    "{a: " * 500 + "1" + "}" * 500, "9" * 5000, "1" * 400, "2024-01-01", "0x1f", "1.0e+30", "-1.0e+30",
    "[" + ", ".join(["x"] * 150_000) + "]", "'" + "y" * 200_000 + "'",
    "[" + ", ".join(["1", "a", "[1]", "{k: v}"] * 2000) + "]",
    "'{{ x | nosuchfilter }}'", "'{% for %}'", "'{{ x is nosuchtest }}'", "'" + "{{ (" * 300 + "'",
    "{SecretAccessKey: abc}", "{s3_additional_kwargs: {SSECustomerAlgorithm: AES256, SSECustomerKey: k}}",
    "{endpoint_url: 'http://user:pass@host:9000'}", "'s3://key:secret@bucket/x'", "/", "'s3://'",
]
SWAPS: list[Any] = [None, True, 0, -1, 3.5, "", "text", [], [1, "a"], {}, {"k": "v"}, 2**70]


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of the document (mappings and lists, leaves and inner nodes)."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _cases() -> list[tuple[str, str, bytes]]:
    """(spec name, what, file bytes) for every fuzz case, from a fixed seed."""
    rng = random.Random(SEED)
    cases = []
    for spec in EXAMPLES:
        base = yaml.safe_load(spec.read_text(encoding="utf-8"))
        paths = _paths(base)
        for n in range(CASES_PER_SPEC):
            doc, path = copy.deepcopy(base), paths[n % len(paths)]
            kind = rng.choice(["swap", "raw", "raw", "unknown", "delete"])
            raw = None
            if kind == "swap":
                _set(doc, path, rng.choice(SWAPS))
            elif kind == "raw":
                raw = rng.choice(RAW_VALUES)
                _set(doc, path, RAW)
            elif kind == "unknown":
                parent = path[:-1]
                node = doc
                for key in parent:
                    node = node[key]
                if isinstance(node, dict):
                    node[f"bogus_{n}"] = 1
                else:
                    _set(doc, path, {f"bogus_{n}": 1})
            elif isinstance(path[-1], str):
                node = doc
                for key in path[:-1]:
                    node = node[key]
                del node[path[-1]]
            text = yaml.safe_dump(doc, sort_keys=False, width=10**9)
            if raw is not None:
                text = text.replace(repr(RAW), raw).replace(RAW, raw)
            what = f"{kind} {'.'.join(map(str, path))}" + (f" = {raw[:40]!r}" if raw else "")
            cases.append((spec.name, what, text.encode("utf-8")))
    # Whole-file cases: encodings, size, structure.
    text = EXAMPLES[0].read_text(encoding="utf-8")
    latin = text.encode("ascii", "replace") + "# café\n".encode("latin-1")
    whole = [("utf-16", text.encode("utf-16")), ("utf-16-be", text.encode("utf-16-be")),
             ("utf-32", text.encode("utf-32")), ("latin-1", latin), ("nul byte", text.encode() + b"\x00"),
             ("bom twice", b"\xef\xbb\xbf\xef\xbb\xbf" + text.encode()), ("empty", b""),
             ("list", b"- a\n- b\n"), ("scalar", b"just text\n"), ("two docs", b"a: 1\n---\nb: 2\n"),
             ("2 MB", b"name: " + b"x" * 2_000_000 + b"\n"),
             ("duplicate key", text.encode() + b"model: {}\n"),
             ("tab indent", b"model:\n\tname: demo\n"), ("binary", bytes(range(256)) * 4),
             ("60 MB", b"# " + b"x" * 60_000_000 + b"\n")]
    cases += [("whole file", what, data) for what, data in whole]
    return cases


CASES = _cases()
OVERRIDES = ["sampling.seed=!!float x", "sampling.temperature=.nan", "sampling.top_p=.NaN",
             "runtime.batch_size=1.0e+30", "sampling.stop=[unclosed", "output.storage_options={Key: 1}",
             "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r=1", "runtime.engines=" + "9" * 3000, "prompt.template={{",
             "input.path=" + "x" * 100_000, "model={1: 2}", "output.path=/", "sampling.seed=&a [*a]"]


def _check(capsys, argv: list[str], what: str) -> int:
    start = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert elapsed < TIME_LIMIT_S, f"{what}: took {elapsed:.2f}s"
    assert code in (0, 2), f"{what}: exit {code}\n{err[-2000:]}"
    assert "Traceback" not in err and "Traceback" not in out, f"{what}:\n{err[-2000:]}"
    if code == 2:
        assert err.strip(), f"{what}: exit 2 without saying why"
        assert len(err) < 6000, f"{what}: a {len(err)}-character message"
    return code


def test_fuzzed_specs_exit_0_or_2_quickly_without_traceback(tmp_path: Path, capsys) -> None:
    assert len(CASES) >= 300
    codes = []
    for i, (name, what, data) in enumerate(CASES):
        path = tmp_path / f"case{i}.yaml"
        path.write_bytes(data)
        codes.append(_check(capsys, ["validate", str(path)], f"{name}: {what}"))
    assert codes.count(2) > len(codes) // 2  # most mutations are refused, some are harmless


@pytest.mark.parametrize("override", OVERRIDES, ids=range(len(OVERRIDES)))
def test_hostile_overrides_exit_2(capsys, override: str) -> None:
    assert _check(capsys, ["validate", str(EXAMPLES[0]), "--set", override], override) == 2


@pytest.mark.parametrize("snippet, expected", [
    (".nan", "NaN is not allowed"), ('!!float "x"', "explicit YAML tag"),
    ("{1: x}", "keys must be strings"), (_BOMB, "alias bomb"), ("[" * 3000 + "]" * 3000, "nesting too deep"),
    ("1.0e+30", "greater than the maximum"), ("'" + "y" * 200_000 + "'", "too long"),
], ids=["nan", "tag", "int-key", "bomb", "deep", "huge-number", "huge-string"])
def test_refusals_name_what_is_wrong(tmp_path: Path, capsys, snippet: str, expected: str) -> None:
    doc = yaml.safe_load(EXAMPLES[0].read_text(encoding="utf-8"))
    doc["sampling"]["temperature"] = RAW
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc).replace(RAW, snippet), encoding="utf-8")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err) < 1000, err[:2000]


def test_template_filters_and_tests_are_checked_at_validate(tmp_path: Path, capsys) -> None:
    for template, expected in [("{{ x | nosuchfilter }}", "No filter named 'nosuchfilter'"),
                               ("{% if x is nosuchtest %}y{% endif %}", "no test named 'nosuchtest'")]:
        doc = yaml.safe_load(EXAMPLES[0].read_text(encoding="utf-8"))
        doc["prompt"]["template"] = template
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        assert main(["validate", str(path)]) == 2
        assert expected in capsys.readouterr().err


def test_validate_hint_names_a_flag_validate_has(monkeypatch, capsys) -> None:
    import deepinfer.pipeline.cli.main as cli

    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "cmd_validate", boom)
    assert main(["validate", str(EXAMPLES[0])]) == 1
    assert "-v" in capsys.readouterr().err
    assert main(["validate", str(EXAMPLES[0]), "-v"]) == 1
    assert "Traceback" in capsys.readouterr().err
