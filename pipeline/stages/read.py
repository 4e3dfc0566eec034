"""Listing input files and reading one part of one file (Parquet or JSONL, local or s3:// via fsspec).

The listing is the root of determinism: files are sorted by path, rows are numbered per file in file order
(blank JSONL lines are skipped and not numbered), and a part is a contiguous row range of one file. Reading a
part therefore always yields the same rows, whichever worker reads it and however often.

A file that cannot be decoded as input.format (not Parquet, truncated, a corrupt page or gzip stream) raises
:class:`InputError` naming the file (exit 2), never a bare pyarrow error; with ``input.on_bad_file:
quarantine`` the listing counts an unreadable file as one row and the read stage quarantines its rows with
code BAD_FILE instead (prompt.py). Storage failures (permissions, timeouts) are not "bad files": they
propagate and are classified as such (errors.classify_exception).
"""

from __future__ import annotations

import json
import posixpath
import zlib
from dataclasses import dataclass, field
from typing import Any

from deepinfer.pipeline.errors import InputError, SpecError
from deepinfer.pipeline.parts import relative_input_path

EXTENSIONS = {"parquet": (".parquet", ".pq"), "jsonl": (".jsonl", ".json", ".ndjson", ".jsonl.gz")}
EXTENSIONS["openai_batch"] = EXTENSIONS["jsonl"]  # Batch API input files are JSONL, one request a line
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class InputFile:
    """One input file: `url` is what fsspec opens (protocol included), `path` the filesystem's own path,
    `root` the input root it is relative to, `relpath` the name used in derived row ids."""

    index: int
    url: str
    path: str
    root: str
    relpath: str
    size: int
    num_rows: int
    # JSONL (uncompressed): byte offset of every `stride`-th row, so a part's reader seeks instead of
    # scanning the file from its start. Empty for Parquet (row groups play that role) and compressed files.
    offsets: tuple[int, ...] = ()
    stride: int = 0
    bad: str | None = None  # why the file cannot be read (on_bad_file: quarantine); num_rows is then 1
    # Parquet: the Arrow schema read from the same footer as num_rows, so the kept columns' types need no
    # second open of every file (make_assembler). Not part of equality: it is derived from the file.
    schema: Any = field(default=None, compare=False, repr=False)

    def offset_of(self, row: int) -> int | None:
        """Byte offset of row `row` when it was recorded, else None."""
        if self.stride and row % self.stride == 0 and row // self.stride < len(self.offsets):
            return self.offsets[row // self.stride]
        return None


def filesystem(url: str, storage_options: dict | None):
    """(fsspec filesystem, path without protocol) for a URL or local path."""
    import fsspec

    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _is_data_file(path: str, fmt: str) -> bool:
    name = posixpath.basename(path)
    return not name.startswith(("_", ".")) and name.lower().endswith(EXTENSIONS[fmt])


class WrongFormat(ValueError):
    """The file's bytes are plainly another format than input.format (a Parquet file read as JSONL)."""


# A Parquet file starts (and ends) with these bytes; no JSON line does.
_PARQUET_MAGIC = b"PAR1"


def _is_corrupt(exc: BaseException) -> bool:
    """Whether `exc` says the bytes are not valid input (as opposed to storage failing to deliver them)."""
    import gzip
    import lzma

    import pyarrow as pa

    if isinstance(exc, (WrongFormat, pa.ArrowException, EOFError, zlib.error, gzip.BadGzipFile,
                        lzma.LZMAError)):
        return True
    # pyarrow reports some decoding failures ("Corrupt snappy compressed data") as a plain OSError. A
    # storage failure while pyarrow reads through fsspec is re-raised as the original exception, raised
    # in fsspec or s3fs code; a decoding failure is raised by pyarrow's own (Cython) frames.
    return isinstance(exc, OSError) and exc.errno is None and _raised_in_pyarrow(exc)


def _raised_in_pyarrow(exc: BaseException) -> bool:
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and "pyarrow" in last.tb_frame.f_code.co_filename


def bad_file_error(url: str, fmt: str, exc: BaseException) -> InputError:
    """The exit-2 error for an input file that cannot be decoded, naming the file and what to do."""
    lines = str(exc).strip().splitlines()
    why = (lines[0] if lines else type(exc).__name__)[:200]
    return InputError(f"input file {url} cannot be read as {fmt} ({why}); fix or remove the file, or set "
                      "input.on_bad_file: quarantine to record it in errors/ and go on")


def list_input(path: str, fmt: str, storage_options: dict | None = None,
               stride: int = 0, on_bad_file: str = "fail") -> list[InputFile]:
    """Sorted input files for input.path (file, directory searched recursively, or glob) with row counts
    (and, for uncompressed JSONL with `stride` > 0, the byte offset of every `stride`-th row).

    Directories and globs yield only files with the format's extensions whose names do not start with
    '_' or '.'. Raises SpecError (exit 2) when nothing matches, InputError (exit 2) naming a file that is
    not valid `fmt` unless `on_bad_file` is 'quarantine'; storage failures propagate.
    """
    fs, root = filesystem(path, storage_options)
    if any(c in root for c in _GLOB_CHARS):
        base = root[: min(root.find(c) for c in _GLOB_CHARS if c in root)].rsplit("/", 1)[0]
        found = fs.glob(root, detail=True)
        files = [p for p, info in found.items() if info.get("type") != "directory" and _is_data_file(p, fmt)]
    elif fs.isdir(root):
        base = root.rstrip("/")
        files = [p for p in fs.find(root) if _is_data_file(p, fmt)]
    elif fs.isfile(root):
        base = posixpath.dirname(root)
        files = [root]
    else:
        raise SpecError([f"input.path: {path} does not exist"])
    if not files:
        exts = ", ".join(EXTENSIONS[fmt])
        raise SpecError([f"input.path: no {fmt} files ({exts}) found under {path}"])
    listing = []
    for index, p in enumerate(sorted(files)):
        info = fs.info(p)
        url = fs.unstrip_protocol(p) if "://" in path else p
        rel = relative_input_path(base, p)
        size = int(info.get("size") or 0)
        try:
            n, offsets, schema = count_rows(fs, p, fmt, stride)
        except Exception as exc:
            if not _is_corrupt(exc):
                raise
            error = bad_file_error(url, fmt, exc)
            if on_bad_file != "quarantine":
                raise error from None
            listing.append(InputFile(index, url, p, base, rel, size, 1, (), 0, str(error)))
            continue
        listing.append(InputFile(index, url, p, base, rel, size, n, offsets, stride if offsets else 0,
                                 schema=schema))
    return listing


def _compressed(path: str) -> bool:
    from fsspec.utils import infer_compression

    return infer_compression(path) is not None


def count_rows(fs, path: str, fmt: str, stride: int = 0) -> tuple[int, tuple[int, ...], Any]:
    """(rows, offsets, schema) of one file: the Parquet footer's count and Arrow schema, or the non-blank
    lines of a JSONL file with the byte offset of every `stride`-th of them (uncompressed files only) and
    no schema."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            return pf.metadata.num_rows, (), pf.schema_arrow
    n, pos, offsets = 0, 0, []
    keep = stride > 0 and not _compressed(path)
    with fs.open(path, "rb", compression="infer") as f:
        if f.read(len(_PARQUET_MAGIC)) == _PARQUET_MAGIC:
            # Split on newline bytes, its pages would become rows of garbage, each quarantined.
            raise WrongFormat("it is a Parquet file (set input.format: parquet)")
        f.seek(0)
        for line in f:
            if line.strip():
                if keep and n % stride == 0:
                    offsets.append(pos)
                n += 1
            pos += len(line)
    return n, tuple(offsets), None


def read_rows(url: str, fmt: str, first_row: int, num_rows: int, storage_options: dict | None = None,
              offset: int | None = None) -> list[tuple[dict[str, Any] | None, str | None]]:
    """Rows [first_row, first_row + num_rows) of one file in file order, each as (row, None), or
    (None, problem) for a JSONL line that is not a JSON object (quarantined as BAD_ROW, stage 'read').

    `offset`, when known, is the byte offset of `first_row` (JSONL): the read starts there.
    """
    fs, p = filesystem(url, storage_options)
    try:
        return _read_rows(fs, p, url, fmt, first_row, num_rows, offset)
    except Exception as exc:
        if _is_corrupt(exc):
            raise bad_file_error(url, fmt, exc) from None
        raise


def _read_rows(fs, p: str, url: str, fmt: str, first_row: int, num_rows: int, offset: int | None
               ) -> list[tuple[dict[str, Any] | None, str | None]]:
    if fmt == "parquet":
        return [(row, None) for row in _read_parquet_rows(fs, p, first_row, num_rows)]
    rows: list[tuple[dict[str, Any] | None, str | None]] = []
    index = first_row - 1 if offset is not None else -1
    with fs.open(p, "rb", compression="infer") as f:
        if offset is not None:
            f.seek(offset)
        for line in f:
            if not line.strip():
                continue
            index += 1
            if index < first_row:
                continue
            if index >= first_row + num_rows:
                break
            rows.append(_parse_line(line, index))
    if len(rows) != num_rows:
        raise OSError(f"{url}: expected rows {first_row}..{first_row + num_rows - 1}, found {len(rows)}; "
                      "the file changed since the job was planned")
    return rows


def _parse_line(line: bytes, index: int) -> tuple[dict[str, Any] | None, str | None]:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"line is not valid JSON: {getattr(exc, 'msg', exc)}"
    if not isinstance(row, dict):
        return None, f"line is a JSON {type(row).__name__}, expected an object"
    return row, None


def _read_parquet_rows(fs, path: str, first_row: int, num_rows: int) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        groups, start, offset = [], 0, None
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if start + n > first_row and start < first_row + num_rows:
                groups.append(g)
                offset = start if offset is None else offset
            start += n
        if not groups:
            return []
        table = pa.concat_tables([pf.read_row_group(g) for g in groups])
    table = table.slice(first_row - offset, num_rows)
    if table.num_rows != num_rows:
        raise OSError(f"{path}: expected {num_rows} rows from row {first_row}, found {table.num_rows}")
    return table.to_pylist()
