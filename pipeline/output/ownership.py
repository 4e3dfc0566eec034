"""Which output paths deepinfer may write into, and what --restart may delete there.

deepinfer deletes inside its output path (orphans of killed runs, --restart), so it must be sure the
path is its own. The rule: an output path is usable when it does not exist, is an empty directory, holds
only deepinfer's run bookkeeping (leases of runs, temp files of its writers, a `_FAILED` record), or
holds a deepinfer job record (`_job.json` with the `deepinfer_job` version key). Anything else (a file
at the path, a directory with other files, commit markers without a job record, a foreign `_job.json`)
is refused with exit 2 naming what is there — whatever the flags, so `--restart` never deletes a file
deepinfer did not write. `/` and an object store's root (`s3://`) are refused outright.

What `--restart` deletes (:func:`manifest_objects`) is read from the output's own manifest: `_SUCCESS`,
`_FAILED`, `metrics.json`, the commit markers and the objects they list, orphans under deepinfer's exact
object names (`parts/{part_id}-{sha16}.{ext}`, temp files of dead writers), `_numerics.json`, and
`_job.json` last. A user's
`parts/notes.txt` survives it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.pipeline.errors import JobError, OutputPathError, RetryableError
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.layout import (
    COMMITS_DIR,
    ERRORS_DIR,
    JOB_FILE,
    METRICS_FILE,
    NUMERICS_FILE,
    PARTS_DIR,
    SUCCESS_FILE,
    OutputReader,
)
from deepinfer.pipeline.output.lease import LEASE_DIR

FAILED_FILE = "_FAILED"  # written by the driver of a failed run (job_store.py); ours to remove
_SHOWN = 5
_MARKER = re.compile(r"^\d{5}-\d{10}\.json$")


def _listing(reader: OutputReader, directory: str) -> list[dict]:
    with storage.storage_errors(f"listing {directory}"):
        try:
            kwargs = {} if storage.is_local(reader.fs) else {"refresh": True}
            return list(reader.fs.ls(directory, detail=True, **kwargs))
        except FileNotFoundError:
            return []


def _base(entry: dict) -> str:
    return str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]


def _bookkeeping_only(reader: OutputReader, entries: list[dict]) -> list[str]:
    """The names (relative) under the root that are not deepinfer's run bookkeeping."""
    foreign: list[str] = []
    for entry in entries:
        name = _base(entry)
        is_dir = entry.get("type") == "directory"
        if not is_dir and (name == FAILED_FILE or storage.parse_temp_name(name) is not None):
            continue
        if is_dir and name in (LEASE_DIR, PARTS_DIR, ERRORS_DIR, COMMITS_DIR):
            for child in _listing(reader, reader.path(name)):
                child_name = _base(child)
                lease = name == LEASE_DIR and child_name.endswith(".json")
                if child.get("type") == "directory" or not (lease or storage.parse_temp_name(child_name)):
                    foreign.append(f"{name}/{child_name}")
            continue
        foreign.append(name + ("/" if is_dir else ""))
    return sorted(foreign)


def check_output(reader: OutputReader) -> dict | None:
    """Refuse (OutputPathError, exit 2) an output path deepinfer may not write into; returns the
    `_job.json` record when the path holds a deepinfer job, None when it holds none yet."""
    url = getattr(reader, "url", reader.root)
    if reader.root.strip("/") == "":
        raise OutputPathError(f"output.path {url} is a filesystem or object-store root; name a directory")
    with storage.storage_errors(f"checking {reader.root}"):
        is_file = reader.fs.isfile(reader.root)
    if is_file:
        raise OutputPathError(f"output.path {url} is a file, not a directory; choose a directory path")
    try:
        existing = reader.read_job()
    except RetryableError:
        raise
    except JobError:  # _job.json is not JSON: not a record deepinfer wrote
        existing = {}
    entries = [] if existing is not None else _listing(reader, reader.root)
    if any(_base(e) == JOB_FILE for e in entries):  # a racing submit of this output created it meanwhile
        existing = reader.read_job()
    if existing is not None:
        if not isinstance(existing, dict) or "deepinfer_job" not in existing:
            raise OutputPathError(f"output.path {url} holds a {JOB_FILE} that deepinfer did not write; "
                                  "choose another output path")
        return existing
    foreign = _bookkeeping_only(reader, entries)
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN
                                               else "")
        raise OutputPathError(f"output.path {url} is not empty and holds no deepinfer job ({shown}); "
                              "deepinfer writes only into a new or empty directory or one holding this job. "
                              "Choose another output path (--restart never deletes files deepinfer did "
                              "not write)")
    return None


def manifest_objects(reader: OutputReader) -> list[str]:
    """What --restart deletes, in a kill-safe order: _SUCCESS and _FAILED (the verdicts), the markers
    (un-committing every part), the objects the markers listed, orphans under deepinfer's own names,
    then _numerics.json and _job.json. A kill part-way leaves _job.json, so the next --restart finishes
    the job; objects whose markers are already gone are found again as orphans."""
    markers = reader.read_markers()
    referenced = [reader.path(obj["path"]) for m in markers.values() for obj in m.get("objects", [])
                  if isinstance(obj, dict) and _ours(str(obj.get("path", "")))]
    paths = [reader.path(SUCCESS_FILE), reader.path(FAILED_FILE), reader.path(METRICS_FILE)]
    paths += [reader.marker_path(pid) for pid in markers]
    paths += referenced
    paths += [p for p in reader.find_orphans() if p not in referenced]
    return paths + [reader.path(NUMERICS_FILE), reader.path(JOB_FILE)]


def _ours(rel: str) -> bool:
    """A marker may only reference deepinfer's own data names (a hand-edited marker cannot aim a
    --restart at /etc/passwd or ../elsewhere)."""
    directory, _, name = rel.partition("/")
    return directory in (PARTS_DIR, ERRORS_DIR) and storage.is_data_name(name)


def stored_rows_per_part(url: str, storage_options: dict | None) -> int | None:
    """runtime.rows_per_part of the job already recorded at `url`, or None (no job there, or unreadable:
    the store's own checks then report it)."""
    try:
        fs, root = storage.open_fs(url, storage_options)
        data = storage.read_bytes(fs, storage.join(root, JOB_FILE))
        record: Any = json.loads(data) if data is not None else None
        value = record["spec"]["runtime"]["rows_per_part"]
    except Exception:  # noqa: BLE001 - best effort: begin() reports real problems with the path
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
