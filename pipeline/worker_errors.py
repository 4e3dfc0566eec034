"""Failures in Ray workers keep their exit codes: classified where they happen, not on the driver.

Ray Data re-raises an exception of a UDF (a prepare task, an engine actor's call) as a UserCodeException
that does not keep the original object, and an actor whose constructor raised reaches the driver as the
text of its traceback. The driver reads deepinfer's own errors back from that text
(errors._flattened_verdict), but a raw OSError, botocore error or MemoryError would read as a bug (exit
1): a transient S3 throttle while a worker reads its part must exit 75, a denied bucket 2. So code that
runs in a worker is wrapped by :func:`in_worker`, which classifies a raw exception there, with the object
whole, and re-raises it as the deepinfer error of that verdict (RetryableError, MustFix); a bug stays
what it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from deepinfer.pipeline.errors import ExitCode, JobError, MustFix, RetryableError, classify_exception
from deepinfer.pipeline.failures import first_line

F = TypeVar("F", bound=Callable[..., Any])


def in_worker(fn: F) -> F:
    """`fn` with its raw exceptions re-raised as the deepinfer error of their exit code (module doc)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except JobError:
            raise
        except Exception as exc:
            code, message = classify_exception(exc)
            if code == ExitCode.RETRY:
                raise RetryableError(f"{type(exc).__name__}: {first_line(exc)}") from exc
            if code == ExitCode.USAGE:
                raise MustFix(message) from exc
            raise

    return wrapper  # type: ignore[return-value]
