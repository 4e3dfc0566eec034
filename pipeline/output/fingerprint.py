"""Job fingerprints: what decides a job's output, hashed from content (never timestamps or paths).

Two runs with equal fingerprints produce the same output bytes, so a rerun may resume the other's
committed parts; any difference means the output path holds another job (exit 4 unless --restart).

The fingerprint is a dict of components, each ``{"sha256": ..., "detail": ...}``; ``detail`` keeps what a
human needs to see why two fingerprints differ (:func:`diff_fingerprints`):

* ``model``: the model spec section (minus where it is stored) and the sha256 of ``config.json``,
  ``generation_config.json``, the safetensors index, and of each ``*.safetensors`` file's header (the 8-byte
  length + JSON header: names, dtypes, shapes, offsets) plus 16 evenly spaced 4 KiB windows of its data —
  cheap even for 100 GB checkpoints, yet any retrained weights change it;
* ``tokenizer``: tokenizer.json, tokenizer_config.json, special tokens, chat template and vocab files;
* ``template``: the ``prompt`` spec section (template text, chat/raw, system prompt, ...);
* ``sampling``: the ``sampling`` section including ``seed``;
* ``schema``: ``output_schema``;
* ``output``: the ``output`` section minus ``path`` (format, kept columns, ...);
* ``input``: the ``input`` section minus ``path`` plus the listing: each file's path relative to the input
  root, size, row count and a content checksum (local: sha256 of the bytes; S3: the ETag);
* ``runtime``: the ``runtime`` section minus keys that cannot change output bytes
  (:data:`NON_SEMANTIC_RUNTIME_KEYS`, read from the schema's ``"x-affects-output": false``: today every
  runtime setting, rows_per_part included, since a resume keeps the stored part plan);
* ``deepinfer``: the package version;
* ``eval``: the ``eval`` section, only when the spec has one (it decides the score columns).

Secrets never enter a fingerprint: any ``storage_options`` key is dropped wherever it appears.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import fsspec
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.spec.bounds import keys_not_affecting_output
from deepinfer.pipeline.spec.schema import load_schema
from deepinfer.pipeline.version import __version__

FINGERPRINT_VERSION = 1
# Which runtime settings cannot change output bytes is declared once, in the schema: each such property
# carries "x-affects-output": false (schemas/job.schema.json), so a new setting is classified where it is
# defined, and a resume may change exactly those.
NON_SEMANTIC_RUNTIME_KEYS = keys_not_affecting_output(load_schema(), "runtime")
_DROPPED_KEYS = frozenset({"storage_options"})
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_WINDOWS = 16
_WINDOW_BYTES = 4096


def canonical_json(value: Any) -> bytes:
    """Stable bytes of a JSON-like value (sorted keys, no whitespace) for hashing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _component(detail: Any) -> dict:
    return {"sha256": _sha(canonical_json(detail)), "detail": detail}


def spec_to_dict(spec: Any) -> dict:
    """A plain dict of a job spec given as a mapping, a dataclass, or an object with ``to_dict()``."""
    if isinstance(spec, Mapping):
        return dict(spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.asdict(spec)
    if hasattr(spec, "to_dict"):
        return dict(spec.to_dict())
    raise ValueError(f"job spec must be a mapping or a dataclass, got {type(spec).__name__}")


def _scrub(value: Any, drop: frozenset[str] = _DROPPED_KEYS) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _scrub(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, drop) for v in value]
    return value


def safetensors_digest(path: str) -> str:
    """sha256 over a safetensors file's header and 16 sampled 4 KiB windows of its data (reads ~70 KB)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} > file size {size})")
        h.update(raw + f.read(n))
        data_start, data_len = 8 + n, size - 8 - n
        h.update(str(size).encode())
        if data_len > 0:
            step = max(1, data_len // _WINDOWS)
            for i in range(_WINDOWS):
                f.seek(data_start + min(i * step, data_len - 1))
                h.update(f.read(_WINDOW_BYTES))
    return h.hexdigest()


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_files_digest(model_dir: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(model_files, tokenizer_files)``: name -> sha256 for the files of a local HF model directory."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    names = sorted(os.listdir(model_dir))
    model: dict[str, str] = {}
    for name in names:
        full = os.path.join(model_dir, name)
        if name in MODEL_FILES:
            model[name] = _file_sha(full)
        elif name.endswith(".safetensors"):
            model[f"{name}#sampled"] = safetensors_digest(full)
        elif name.endswith((".bin", ".pt", ".pth")):
            # pickle checkpoints (only with the user's opt-in): size is the cheap proxy we can afford
            model[f"{name}#size"] = str(os.path.getsize(full))
    if not any(k.endswith("#sampled") or k.endswith("#size") for k in model):
        raise ValueError(f"model directory {model_dir!r} holds no weights (*.safetensors)")
    tokenizer = {name: _file_sha(os.path.join(model_dir, name)) for name in names if name in TOKENIZER_FILES}
    return model, tokenizer


def describe_inputs(
    fs: fsspec.AbstractFileSystem,
    paths: Iterable[str],
    input_root: str,
    row_counts: Mapping[str, int] | None = None,
) -> list[dict]:
    """The input listing entries for :func:`job_fingerprint`: relative path, size, checksum (+ row count).

    Local files are hashed in full (sha256, streamed); S3 objects use their ETag (no download).
    """
    from deepinfer.pipeline.parts import relative_input_path

    out = []
    for path in sorted(paths):
        with storage.storage_errors(f"describing input {path}"):
            info = fs.info(path)
            if storage.is_local(fs):
                checksum = "sha256:" + _file_sha(path)
            else:
                etag = info.get("ETag") or info.get("etag") or ""
                checksum = f"etag:{str(etag).strip(chr(34))}" if etag else ""
        entry = {"path": relative_input_path(input_root, path), "size": int(info.get("size") or 0)}
        if checksum:
            entry["checksum"] = checksum
        if row_counts is not None and path in row_counts:
            entry["num_rows"] = int(row_counts[path])
        out.append(entry)
    return out


def _normalize_listing(listing: Sequence[Any]) -> list[dict]:
    entries = []
    for item in listing:
        if isinstance(item, Mapping):
            if "path" not in item:
                raise ValueError(f"input listing entry has no 'path': {item!r}")
            entries.append({str(k): item[k] for k in sorted(item)})
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            entries.append({"path": str(item[0]), "num_rows": int(item[1])})
        else:
            raise ValueError(f"input listing entries must be dicts or (path, num_rows), got {item!r}")
    return sorted(entries, key=lambda e: e["path"])


def job_fingerprint(spec: Any, model_dir: str | None, input_listing: Sequence[Any]) -> dict:
    """The fingerprint of a job (see the module docstring); JSON-serializable and deterministic.

    ``spec``: the resolved spec (mapping/dataclass) with sections model, input, prompt, sampling,
    output_schema, output, runtime. ``model_dir``: local model directory whose files are hashed, or None
    when the model is not a directory (e.g. a built-in demo model named in the spec). ``input_listing``:
    entries from :func:`describe_inputs`, or ``(path, num_rows)`` pairs.
    """
    s = _scrub(spec_to_dict(spec))
    model_section = s.get("model")
    tokenizer_files: dict[str, str] = {}
    if model_dir is not None:
        model_files, tokenizer_files = model_files_digest(model_dir)
        if isinstance(model_section, Mapping):
            model_section = {k: v for k, v in model_section.items() if k not in ("path", "cache_dir")}
        else:
            model_section = None  # the string named where the model is; its content is hashed instead
        model_detail: dict = {"spec": model_section, "files": model_files}
    else:
        model_detail = {"spec": model_section, "files": {}}
    output = {k: v for k, v in (s.get("output") or {}).items() if k != "path"}
    input_section = {k: v for k, v in (s.get("input") or {}).items() if k != "path"}
    runtime = {k: v for k, v in (s.get("runtime") or {}).items() if k not in NON_SEMANTIC_RUNTIME_KEYS}
    extra = {}
    if s.get("eval") is not None:
        # score columns and metrics.json depend on it; a component only when present, so the
        # fingerprints of jobs without an eval (and their resumes) are what they always were
        extra["eval"] = _component(s.get("eval"))
    if s.get("output_schema_mode") not in (None, "strict"):  # the default keeps older fingerprints as is
        extra["schema_mode"] = _component(s.get("output_schema_mode"))
    return {
        "version": FINGERPRINT_VERSION,
        "deepinfer": _component(__version__),
        "model": _component(model_detail),
        "tokenizer": _component({"files": tokenizer_files}),
        "template": _component(s.get("prompt")),
        "sampling": _component(s.get("sampling")),
        "schema": _component(s.get("output_schema")),
        "output": _component(output),
        "input": _component({"spec": input_section, "files": _normalize_listing(input_listing)}),
        "runtime": _component(runtime),
        **extra,
    }


_LABELS = {
    "version": "fingerprint format",
    "deepinfer": "deepinfer version",
    "model": "model",
    "tokenizer": "tokenizer",
    "template": "prompt template",
    "sampling": "sampling",
    "schema": "output_schema",
    "output": "output",
    "input": "input",
    "runtime": "runtime",
    "eval": "eval",
    "schema_mode": "output_schema_mode",
}
_MAX_ITEMS = 5


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _diff_values(path: str, a: Any, b: Any, out: list[str]) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append(f"{sub} added ({_short(b[key])})")
            elif key not in b:
                out.append(f"{sub} removed (was {_short(a[key])})")
            elif a[key] != b[key]:
                _diff_values(sub, a[key], b[key], out)
    elif a != b:
        out.append(f"{path or 'value'}: {_short(a)} -> {_short(b)}")


def _diff_files(a: list[dict], b: list[dict]) -> list[str]:
    am, bm = {e["path"]: e for e in a}, {e["path"]: e for e in b}
    added = sorted(set(bm) - set(am))
    removed = sorted(set(am) - set(bm))
    changed = sorted(p for p in set(am) & set(bm) if am[p] != bm[p])
    out = []
    for verb, names in (("added", added), ("removed", removed), ("changed", changed)):
        if names:
            more = f" and {len(names) - _MAX_ITEMS} more" if len(names) > _MAX_ITEMS else ""
            out.append(f"{len(names)} file(s) {verb}: {', '.join(names[:_MAX_ITEMS])}{more}")
    return out


def diff_fingerprints(a: Mapping, b: Mapping) -> list[str]:
    """Human-readable differences between two fingerprints (old ``a``, new ``b``); empty when equal."""
    out: list[str] = []
    keys = set(a) | set(b)
    for key in [k for k in _LABELS if k in keys] + sorted(k for k in keys if k not in _LABELS):
        ca, cb = a.get(key), b.get(key)
        if ca == cb:
            continue
        label = _LABELS.get(key, key)
        if not (isinstance(ca, Mapping) and isinstance(cb, Mapping) and "detail" in ca and "detail" in cb):
            out.append(f"{label}: {_short(ca)} -> {_short(cb)}")
            continue
        if ca.get("sha256") == cb.get("sha256"):
            continue
        da, db = ca["detail"], cb["detail"]
        details: list[str] = []
        if key == "input" and isinstance(da, Mapping) and isinstance(db, Mapping):
            _diff_values("", da.get("spec"), db.get("spec"), details)
            details += _diff_files(da.get("files") or [], db.get("files") or [])
        elif key in ("model", "tokenizer") and isinstance(da, Mapping) and isinstance(db, Mapping):
            _diff_values("", da.get("spec"), db.get("spec"), details)
            fa, fb = da.get("files") or {}, db.get("files") or {}
            for name in sorted(set(fa) | set(fb)):
                if fa.get(name) != fb.get(name):
                    verb = "added" if name not in fa else "removed" if name not in fb else "changed"
                    details.append(f"{name.split('#')[0]} {verb}")
        else:
            _diff_values("", da, db, details)
        if not details:
            details = ["content changed"]
        shown = details[:_MAX_ITEMS]
        if len(details) > _MAX_ITEMS:
            shown.append(f"... {len(details) - _MAX_ITEMS} more")
        out.append(f"{label}: {'; '.join(shown)}")
    return out
