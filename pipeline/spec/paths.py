"""Where a job may write: the checks `validate` can make on output.path from the spec alone.

An output path belongs to one job, and deepinfer deletes inside it (orphans of killed runs, --restart).
So it must never be a filesystem root or the whole object store, and it must not overlap the input: an
output inside the input's directory tree is read back as input by the next run (which then is another
job, exit 4, forever), and an input inside the output could be deleted by --restart. What is already
*in* an existing output directory is checked at submit (output/commit.py), where the storage is open.
"""

from __future__ import annotations

import os
import posixpath

from deepinfer.pipeline.spec.yaml_common import short

_GLOB_CHARS = "*?["
# The storage deepinfer reads input from and commits output to (output/storage.py opens them): local disk
# and S3. Any other scheme would fail only when the job runs, as a bug (exit 1) or, for a network scheme
# whose host does not answer, as a transient failure (exit 75) that no rerun can cure.
STORAGE_SCHEMES = ("file", "local", "s3", "s3a")
# Extensions of a single input file (pipeline/stages/read.py lists the same); a path without one that
# does not exist yet is taken to be a directory, which is the cautious reading for the overlap check.
_FILE_EXTENSIONS = (".parquet", ".pq", ".jsonl", ".json", ".ndjson", ".gz")


def _is_remote(path: str) -> bool:
    return "://" in path


def _normal(path: str) -> str:
    """A comparable form: local paths absolute and normalised, URLs with one trailing-slash-free form."""
    if _is_remote(path):
        scheme, _, rest = path.partition("://")
        rest = posixpath.normpath("/" + rest).lstrip("/") if rest.strip("/") else ""
        return f"{scheme.lower()}://{rest}"
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def input_tree(path: str) -> str | None:
    """The directory whose tree the input is read from: the directory itself or a glob's fixed prefix;
    None for a single file, which cannot pick up anything else."""
    norm = _normal(path)
    if any(c in norm for c in _GLOB_CHARS):
        base = norm[: min(norm.find(c) for c in _GLOB_CHARS if c in norm)]
        return base.rsplit("/", 1)[0] if "/" in base else base
    if not _is_remote(norm) and os.path.isfile(norm):
        return None
    if norm.lower().endswith(_FILE_EXTENSIONS) and (_is_remote(norm) or not os.path.isdir(norm)):
        return None
    return norm


def _inside(child: str, parent: str) -> bool:
    parent = parent.rstrip("/")
    return child == parent or child.startswith(parent + "/")


def scheme_problems(path: str, where: str) -> list[str]:
    """A URL scheme deepinfer has no storage for (`where`: the field, e.g. input.path)."""
    if not isinstance(path, str) or not _is_remote(path):
        return []
    scheme = path.partition("://")[0].lower()
    if scheme in STORAGE_SCHEMES:
        return []
    return [f"{where}: {short(path)} uses {scheme}://, which deepinfer cannot read or write; use a local "
            "path or s3://bucket/prefix"]


def output_path_problems(output: str, input_path: str) -> list[str]:
    """Problems of output.path given input.path (empty when the pair is fine)."""
    out = _normal(output)
    if _is_remote(out):
        scheme, _, rest = out.partition("://")
        if not rest:
            return [f"output.path: {short(output)} is the whole {scheme}:// store; name a bucket and a "
                    "prefix (s3://bucket/prefix)"]
    elif out == os.path.dirname(out):  # "/" (or a drive root): deepinfer would own the filesystem
        return [f"output.path: {short(output)} is a filesystem root; name a directory of its own"]
    source, tree = _normal(input_path), input_tree(input_path)
    if out == source:
        return ["output.path: must differ from input.path"]
    if tree is not None and _inside(out, tree):
        return [f"output.path: {short(output)} is inside the input's directory tree ({short(tree)}); the "
                "next run would read the output as input. Choose an output path outside it"]
    if _inside(source, out) or (tree is not None and _inside(tree, out)):
        return [f"output.path: {short(output)} contains the input ({short(input_path)}); --restart and "
                "cleanup delete inside the output path. Choose an output path that does not hold the input"]
    return []
