"""The job output layout and its read side: markers, committed tables, orphan detection.

::

    _job.json                   job record: resolved spec, fingerprint, part plan (put-if-absent, first write)
    parts/{part_id}-{h}.{ext}   result rows of one part ({h}: first 16 hex digits of the object's sha256)
    errors/{part_id}-{h}.{ext}  quarantined rows of one part (only when it has any)
    _commits/{part_id}.json     commit marker (put-if-absent): {"part_id", "format", "rows", "error_rows",
                                "error_codes": {code: n}, "objects": [{"kind", "path", "rows", "bytes",
                                "sha256"}], "numerics": [stacks of the engines that generated its rows]}
    _numerics.json              {"numerics": the stack the first commit's engine computed with} (numerics.py)
    metrics.json                with `eval:`: n, mean, standard error per metric (and group), before _SUCCESS
    _SUCCESS                    written last: {"parts", "rows", "error_rows", "summary"}
    _runs/{run_id}.json         leases of live runs (lease.py); removed when runs end

Readers must go through markers: a data object without a marker is an orphan of a killed run, not output.
Nothing here writes or deletes; that is the committer's business (commit.py).
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import pyarrow as pa
from deepinfer.pipeline.errors import ERROR_SCHEMA, OutputPathError
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.encoding import decode_table
from deepinfer.pipeline.output.lease import LEASE_DIR, process_alive
from deepinfer.pipeline.parts import PART_ID_LEN, is_part_id

JOB_FILE = "_job.json"
SUCCESS_FILE = "_SUCCESS"
PARTS_DIR = "parts"
ERRORS_DIR = "errors"
COMMITS_DIR = "_commits"
METRICS_FILE = "metrics.json"  # an `eval:` job's metrics (evaluation.py), written before _SUCCESS
NUMERICS_FILE = "_numerics.json"  # the numerics stack of the job's parts (numerics.py), with its first commit


def dumps(value: Any) -> bytes:
    """The canonical bytes of the JSON files of an output (sorted keys: byte-identical across runs)."""
    return (json.dumps(value, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


class OutputReader:
    """Read-only view of one output: ``fs`` and ``root`` as returned by :func:`storage.open_fs`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root

    def path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def marker_path(self, part_id: str) -> str:
        return self.path(COMMITS_DIR, f"{part_id}.json")

    def _read_json(self, path: str, corrupt: str) -> dict | None:
        """The JSON object at ``path``; None when absent; OutputPathError(``corrupt``, exit 2: a person must
        look at the output) when it does not parse."""
        data = storage.read_bytes(self.fs, path)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise OutputPathError(corrupt) from exc

    def read_job(self) -> dict | None:
        """The ``_job.json`` record, or None when the output holds no job yet."""
        path = self.path(JOB_FILE)
        return self._read_json(path, f"{path} is not valid JSON: the output was changed outside deepinfer, "
                                     "or is not a deepinfer output")

    def read_success(self) -> dict | None:
        data = storage.read_bytes(self.fs, self.path(SUCCESS_FILE))
        return None if data is None else json.loads(data)

    def is_complete(self) -> bool:
        """True when ``_SUCCESS`` exists (the job finished)."""
        with storage.storage_errors(f"checking {self.path(SUCCESS_FILE)}"):
            return self.fs.exists(self.path(SUCCESS_FILE))

    def committed_part_ids(self) -> set[str]:
        """Ids of the parts whose commit marker exists."""
        names = storage.list_names(self.fs, self.path(COMMITS_DIR))
        return {n[: -len(".json")] for n in names if n.endswith(".json") and is_part_id(n[: -len(".json")])}

    def read_marker(self, part_id: str) -> dict | None:
        path = self.marker_path(part_id)
        return self._read_json(path, f"commit marker {path} of part {part_id} is not valid JSON (changed "
                                     "outside deepinfer)")

    def read_markers(self) -> dict[str, dict]:
        """part_id -> marker, for every committed part, in part order (fetched concurrently on S3)."""
        ids = sorted(self.committed_part_ids())
        blobs = storage.read_many(self.fs, [self.marker_path(pid) for pid in ids])
        out = {}
        for pid in ids:
            try:
                out[pid] = json.loads(blobs[self.marker_path(pid)])
            except (KeyError, ValueError) as exc:
                raise OutputPathError(f"commit marker {self.marker_path(pid)} of part {pid} is missing or "
                                      "not valid JSON (changed outside deepinfer)") from exc
        return out

    def read_committed(self, kind: str = PARTS_DIR) -> pa.Table:
        """All committed result rows (``kind="parts"``) or error rows (``"errors"``) in input order.

        Every object's sha256 is checked against its marker; a mismatch raises OutputPathError (exit 2).
        """
        if kind not in (PARTS_DIR, ERRORS_DIR):
            raise ValueError(f"kind must be 'parts' or 'errors', got {kind!r}")
        tables = []
        for part_id, marker in self.read_markers().items():
            for obj in marker.get("objects", []):
                if obj["kind"] != kind:
                    continue
                data = storage.read_bytes(self.fs, self.path(obj["path"]))
                if data is None or storage.sha256_hex(data) != obj["sha256"]:
                    raise OutputPathError(f"part {part_id}: {obj['path']} is missing or does not match its "
                                          "commit marker (changed outside deepinfer; `deepinfer-job verify` "
                                          "lists every such file)")
                tables.append(decode_table(data, marker["format"]))
        if not tables:
            return ERROR_SCHEMA.empty_table() if kind == ERRORS_DIR else pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def list_objects(self) -> list[str]:
        """Every object under the output (relative paths, sorted) except run leases — for tests and audits."""
        with storage.storage_errors(f"listing {self.root}"):
            found = self.fs.find(self.root) if self.fs.exists(self.root) else []
        prefix = self.root.rstrip("/") + "/"
        rel = [p[len(prefix) :] if p.startswith(prefix) else p for p in found]
        return sorted(r for r in rel if not r.startswith(LEASE_DIR + "/"))

    def find_orphans(self) -> list[str]:
        """Objects no marker references: data of uncommitted parts, extra objects of committed parts (a
        losing racer's, when outputs were not deterministic), temp files of dead local writers, and a
        `_numerics.json` while no part is committed (its run died before its first marker). Only
        deepinfer's own names are candidates (storage.is_data_name): a user's file is never an orphan."""
        committed = self.committed_part_ids()
        out: list[str] = []
        for directory in (PARTS_DIR, ERRORS_DIR, COMMITS_DIR, ""):
            names = storage.list_names(self.fs, self.path(directory) if directory else self.root)
            per_part: dict[str, list[str]] = {}
            for name in names:
                tmp = storage.parse_temp_name(name)
                if tmp is not None:
                    if process_alive(tmp[0], tmp[1]) is False:
                        out.append(self.path(directory, name) if directory else self.path(name))
                    continue
                if directory in (PARTS_DIR, ERRORS_DIR) and storage.is_data_name(name):
                    per_part.setdefault(name[:PART_ID_LEN], []).append(name)
                elif not directory and name == NUMERICS_FILE and not committed:  # claimed, never committed
                    out.append(self.path(name))
            for part_id, part_names in sorted(per_part.items()):
                if part_id not in committed:
                    out += [self.path(directory, n) for n in part_names]
                elif len(part_names) > 1:
                    marker = self.read_marker(part_id) or {}
                    keep = {o["path"] for o in marker.get("objects", [])}
                    out += [self.path(directory, n) for n in part_names if f"{directory}/{n}" not in keep]
        return out

    def has_any_data(self) -> bool:
        return any(storage.list_names(self.fs, self.path(d)) for d in (PARTS_DIR, ERRORS_DIR, COMMITS_DIR))
