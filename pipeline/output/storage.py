"""Storage primitives for the commit protocol, over fsspec (local disk and S3).

Only two backends are supported for job output, because only they give us what exactly-once needs:

* local disk: atomic publish by ``os.replace`` of a fully written, fsynced temp file in the same directory,
  and create-if-absent by ``os.link`` of such a temp file (fails with EEXIST, never exposes partial bytes);
* S3 (s3fs): a single PUT is atomic, and create-if-absent is a conditional PUT with ``If-None-Match: *``
  (``S3FileSystem.pipe_file(mode="create")``; AWS S3 since 2024, moto >= 5.0.17 — tested in
  tests/pipeline/test_commit.py). S3 objects are never renamed.

Temp files (local only) are named ``.tmp-{host}-{pid}-{random}-{name}`` so that cleanup can tell those of a
dead writer (removable) from those of a live one (never touched).

Errors from the storage layer that a later retry can cure (connection refused/reset, timeouts, DNS, 5xx,
throttling, disk full) are re-raised as :class:`RetryableStorageError` (the CLI exits 75) by
:func:`storage_errors`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from deepinfer.pipeline.errors import RetryableStorageError
from deepinfer.pipeline.spec.paths import STORAGE_SCHEMES
from fsspec.implementations.local import LocalFileSystem

TEMP_PREFIX = ".tmp-"
SUPPORTED_PROTOCOLS = STORAGE_SCHEMES

_RETRYABLE_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    errno.EBUSY,  # s3fs: SlowDown / ServiceUnavailable (503)
    errno.EAGAIN,
    errno.EIO,
    errno.ENOSPC,
    errno.EDQUOT,
    getattr(errno, "EREMOTEIO", 121),  # s3fs: InternalError (500)
}
_RETRYABLE_NAMES = {
    # botocore / aiohttp / urllib3 connection-level failures, matched by class name so that this module
    # does not import the S3 stack when only local disk is used
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ProxyConnectionError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientOSError",
    "NewConnectionError",
    "MaxRetryError",
}


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve an output/input URL to ``(filesystem, root)``; ``root`` has no protocol and no trailing slash.

    Local paths (``/x``, ``./x``, ``file:///x``) become absolute. ``storage_options`` go to the fsspec
    filesystem (for S3 e.g. ``{"client_kwargs": {"endpoint_url": ...}}``; credentials come from the usual
    AWS environment/config). Raises ValueError for other protocols: only local disk and S3 give the atomic
    primitives the commit protocol needs.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"output.path must be a non-empty path or s3:// URL, got {url!r}")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in SUPPORTED_PROTOCOLS:
        raise ValueError(
            f"storage URL {url!r}: protocol {protocol!r} is not supported for job output; "
            "use a local path or s3://bucket/prefix"
        )
    if protocol in ("file", "local") and "://" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        # commit decisions must see the bucket as it is now, never a cached listing
        options.setdefault("use_listings_cache", False)
    with storage_errors(f"opening {url}"):
        fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root.rstrip("/") or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local-disk filesystem (atomic rename and hard links available)."""
    return isinstance(fs, LocalFileSystem)


def join(*parts: str) -> str:
    """Join storage path components with '/' (fsspec paths use '/' on every backend)."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def host_tag() -> str:
    """A short stable tag of this machine (hostname + boot id), used in lease and temp names."""
    boot = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    return hashlib.sha256(f"{socket.gethostname()}|{boot}".encode()).hexdigest()[:12]


def temp_name_for(final_path: str) -> str:
    """A unique temp path in the same directory as ``final_path`` (so that rename/link stay atomic)."""
    head, _, name = final_path.rpartition("/")
    tmp = f"{TEMP_PREFIX}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"
    return f"{head}/{tmp}" if head else tmp


_DATA_NAME = re.compile(r"^\d{5}-\d{10}-[0-9a-f]{16}\.(?:parquet|jsonl)$")


def is_data_name(name: str) -> bool:
    """Whether `name` is one of deepinfer's data object names, ``{part_id}-{sha16}.{ext}``: the only names
    under parts/ and errors/ that cleanup and --restart may delete."""
    return bool(_DATA_NAME.match(name))


def parse_temp_name(name: str) -> tuple[str, int] | None:
    """``(host_tag, pid)`` of the writer of a temp file name, or None when ``name`` is not one of ours."""
    if not name.startswith(TEMP_PREFIX):
        return None
    fields = name[len(TEMP_PREFIX) :].split("-", 3)
    if len(fields) < 4 or not fields[1].isdigit():
        return None
    return fields[0], int(fields[1])


def _fsync_dir(path: str) -> None:
    # makes the rename/link itself durable; some filesystems refuse O_RDONLY dirs: best effort there
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_temp_local(final_path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(final_path), exist_ok=True)
    tmp = temp_name_for(final_path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` so that readers see either the old object or all of the new bytes.

    Local: temp file in the same directory, fsync, ``os.replace``, fsync of the directory.
    S3: one PUT (atomic by S3's semantics). Overwrites an existing object.
    """
    with storage_errors(f"writing {path}"):
        if is_local(fs):
            tmp = _write_temp_local(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(os.path.dirname(path))
        else:
            _require_s3(fs)
            fs.pipe_file(path, data)


def put_if_absent(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` only if nothing exists there; True if we created it, False if it existed.

    Atomic and exclusive: of any number of concurrent callers exactly one gets True, and no reader ever sees
    a partially written object. Local: hard link of a fsynced temp file (EEXIST = lost), falling back to
    ``O_CREAT|O_EXCL`` on filesystems without hard links. S3: conditional PUT ``If-None-Match: *``
    (HTTP 412 = lost).
    """
    with storage_errors(f"creating {path}"):
        if is_local(fs):
            return _put_if_absent_local(path, data)
        _require_s3(fs)
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True


def _put_if_absent_local(path: str, data: bytes) -> bool:
    tmp = _write_temp_local(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        return _put_if_absent_excl(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _fsync_dir(os.path.dirname(path))
    return True


def _put_if_absent_excl(path: str, data: bytes) -> bool:
    # filesystems without hard links: exclusive create, then write; a crash mid-write can leave a short
    # file, which readers of markers detect (they are JSON with checksums) and report as corrupt
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(os.path.dirname(path))
    return True


def _require_s3(fs: fsspec.AbstractFileSystem) -> None:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if not any(p in ("s3", "s3a") for p in protocols):
        raise ValueError(f"filesystem {type(fs).__name__} has no atomic create-if-absent; use local or s3")


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    with storage_errors(f"reading {path}"):
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            return None


def read_many(fs: fsspec.AbstractFileSystem, paths: list[str]) -> dict[str, bytes]:
    """path -> bytes for the given objects that exist (fetched concurrently by s3fs)."""
    if not paths:
        return {}
    with storage_errors(f"reading {len(paths)} objects"):
        if is_local(fs):
            out = {}
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    with open(path, "rb") as f:
                        out[path] = f.read()
            return out
        found = fs.cat(paths, on_error="return")
    out = {}
    for path, value in found.items():
        if isinstance(value, FileNotFoundError):
            continue
        if isinstance(value, BaseException):
            with storage_errors(f"reading {path}"):
                raise value
        out[_unprotocol(path)] = value
    return {p: out[_unprotocol(p)] for p in paths if _unprotocol(p) in out}


def _unprotocol(path: str) -> str:
    return path.split("://", 1)[-1]


def list_names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """Sorted base names of the files directly under ``directory`` (empty when it does not exist)."""
    with storage_errors(f"listing {directory}"):
        try:
            kwargs = {} if is_local(fs) else {"refresh": True}
            entries = fs.ls(directory, detail=True, **kwargs)
        except FileNotFoundError:
            return []
    names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") != "directory"]
    return sorted(names)


def remove(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Delete one object; True if it existed. Idempotent (safe to repeat after a kill)."""
    with storage_errors(f"deleting {path}"):
        try:
            if is_local(fs):
                os.unlink(path)
            else:
                if not fs.exists(path):
                    return False
                fs.rm_file(path)
        except FileNotFoundError:
            return False
    return True


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything in its cause/context chain) is a transient storage/infra failure."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, RetryableStorageError):
            return True
        if isinstance(cur, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if type(cur).__name__ in _RETRYABLE_NAMES:
            return True
        if isinstance(cur, OSError) and not isinstance(cur, (FileNotFoundError, FileExistsError)):
            if cur.errno in _RETRYABLE_ERRNOS:
                return True
        cur = cur.__cause__ or cur.__context__
    return False


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Re-raise transient storage failures inside the block as :class:`RetryableStorageError`."""
    try:
        yield
    except RetryableStorageError:
        raise
    except Exception as exc:
        if is_retryable(exc):
            raise RetryableStorageError(f"storage failure while {what}: {type(exc).__name__}: {exc}") from exc
        raise
