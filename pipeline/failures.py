"""Which failures a person must fix (exit 2) rather than wait out (exit 75): the rules behind
errors.classify_exception, kept apart so that errors.py stays the small home of the error types.

Stdlib only, and duck-typed (no botocore or ray import): a botocore ClientError is recognised by its
``response`` mapping, Ray's wrappers by their module name.
"""

from __future__ import annotations

import errno
import re

# errnos of OSErrors that no retry cures.
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EROFS,
                     errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.ENOSYS, errno.EEXIST}
# S3 error codes (botocore ClientError) a person must fix; 4xx codes not listed are treated the same way,
# 5xx and the throttling codes below are transient.
_S3_FIX = {"AccessDenied": "access denied: check the credentials' permissions for this bucket/prefix",
           "InvalidAccessKeyId": "the AWS access key id is not valid: check the credentials",
           "SignatureDoesNotMatch": "the AWS secret key does not match: check the credentials",
           "ExpiredToken": "the AWS session token has expired: refresh the credentials",
           "InvalidToken": "the AWS session token is not valid: refresh the credentials",
           "NoSuchBucket": "the bucket does not exist: check the path's bucket name",
           "AllAccessDisabled": "all access to this bucket is disabled",
           "InvalidBucketName": "the bucket name is not valid"}
_S3_TRANSIENT = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                 "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException"}
# What one of deepinfer's errors looks like once Ray has flattened it into text (the traceback line
# "deepinfer.pipeline.errors.Name: message", a message's continuation lines indented).
_FLATTENED = re.compile(r"\bdeepinfer\.pipeline\.errors\.(\w+): ([^\n]*(?:\n  [^\n]*)*)")


def s3_code(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of a botocore ClientError, else None (duck-typed: no botocore import)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, int(status or (int(code) if code.isdigit() else 0))


def must_fix(e: BaseException) -> str | None:
    """What a person must fix when `e` is a permanent environment failure, else None."""
    what = first_line(e)
    s3 = s3_code(e)
    if s3 is not None:
        code, status = s3
        if code in _S3_TRANSIENT or status >= 500 or status == 429:
            return None
        return f"{_S3_FIX.get(code, f'S3 refused the request ({code or status})')}: {what}"
    name = type(e).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (f"no usable AWS credentials ({name}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE")
    if isinstance(e, MemoryError):
        return ("out of memory: lower runtime.batch_size, runtime.sort_window or runtime.max_num_seqs, "
                "or run on a machine with more memory")
    if isinstance(e, PermissionError):
        return f"permission denied: {what} (check the credentials or the path's permissions)"
    if isinstance(e, FileNotFoundError):
        return f"not found: {what} (check the path, or that the bucket exists)"
    if isinstance(e, NotADirectoryError):
        return f"a path component is a file, not a directory: {what}"
    if isinstance(e, IsADirectoryError):
        return f"a directory where a file was expected: {what}"
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        return f"read-only file system: {what} (choose a writable output.path)"
    if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)) \
            and e.errno in _PERMANENT_ERRNOS:
        return f"{type(e).__name__}: {what}"
    return None


def flattened_error(e: BaseException) -> tuple[str, str] | None:
    """(class name, message) of the last of deepinfer's errors in the text of Ray wrapper `e` (the one
    deepinfer's code raised last, when one wraps another), or None."""
    if not type(e).__module__.startswith("ray"):
        return None
    matches = _FLATTENED.findall(str(e))
    return (matches[-1][0], matches[-1][1]) if matches else None


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"
