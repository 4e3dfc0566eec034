"""Mapping what ended a run to the CLI's exit codes (see cli.py) and a one-line message.

2: the user's spec or usage is wrong (SpecError). 3: error budget exceeded. 4: the output path belongs to
another job. 75: something that may work when retried — storage I/O, a lost Ray worker or actor, an engine
out of memory. 1: anything else is a bug in deepinfer.
"""

from __future__ import annotations

import sys


class ErrorBudgetExceeded(RuntimeError):
    """More rows were quarantined than runtime.max_error_fraction allows (exit 3)."""


class InputError(ValueError):
    """The input cannot be read as specified (malformed file, not a row-level problem): exit 2."""


EXIT_BUG, EXIT_USAGE, EXIT_BUDGET, EXIT_OTHER_JOB, EXIT_RETRY = 1, 2, 3, 4, 75


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        inner = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the user exception here
        exc = inner if isinstance(inner, BaseException) else (exc.__cause__ or exc.__context__)
    return chain


def _retryable_types() -> tuple[type, ...]:
    types: list[type] = [OSError, ConnectionError, TimeoutError, MemoryError]
    ray = sys.modules.get("ray.exceptions")
    if ray is not None:
        for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                     "NodeDiedError", "ObjectLostError", "OwnerDiedError", "RaySystemError",
                     "GetTimeoutError",
                     "OutOfMemoryError", "ObjectStoreFullError"):
            t = getattr(ray, name, None)
            if isinstance(t, type):
                types.append(t)
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        types.append(botocore.BotoCoreError)
        types.append(botocore.ClientError)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda") and hasattr(torch.cuda, "OutOfMemoryError"):
        types.append(torch.cuda.OutOfMemoryError)
    return tuple(types)


def _commit_errors():
    """The commit helper's exception classes, when present: (fingerprint mismatch, retryable storage)."""
    try:
        from . import errors
    except ImportError:
        return (), ()
    mismatch = tuple(t for t in (getattr(errors, "FingerprintMismatch", None),) if isinstance(t, type))
    retry = tuple(t for n in ("RetryableError", "StorageError", "CommitConflict")
                  if isinstance(t := getattr(errors, n, None), type))
    return mismatch, retry


def classify_exception(exc: BaseException) -> tuple[int, str]:
    """(exit code, message) for `exc`; looks through Ray's task-error wrappers at the original cause."""
    from .spec_schema import SpecError

    mismatch, commit_retry = _commit_errors()
    chain = _cause_chain(exc)
    for e in chain:
        code = getattr(e, "exit_code", None)
        if isinstance(code, int) and code in (EXIT_USAGE, EXIT_BUDGET, EXIT_OTHER_JOB, EXIT_RETRY):
            return code, str(e)
        if isinstance(e, SpecError):
            return EXIT_USAGE, str(e)
        if isinstance(e, InputError):
            return EXIT_USAGE, f"invalid input: {e}"
        if isinstance(e, ErrorBudgetExceeded):
            return EXIT_BUDGET, str(e)
        if mismatch and isinstance(e, mismatch):
            return EXIT_OTHER_JOB, f"output path holds another job: {e}"
        if commit_retry and isinstance(e, commit_retry):
            return EXIT_RETRY, f"retryable storage failure: {e} (run the same command again; it resumes)"
    retryable = _retryable_types()
    for e in chain:
        if isinstance(e, retryable):
            return EXIT_RETRY, (f"retryable failure: {type(e).__name__}: {_first_line(e)} "
                                "(run the same command again; it resumes)")
    return EXIT_BUG, f"unexpected error: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""
