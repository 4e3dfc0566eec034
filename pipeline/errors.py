"""Job failure types with their exit codes, and quarantined ("poison") error rows.

Exit codes are a contract (DESIGN.md): 0 done (errors within budget), 2 invalid spec or usage, 3 error
budget exceeded, 4 output path holds another job (different fingerprint), 75 retryable failure
(storage/engine/infra), 1 bug. Every exception a job raises on purpose derives from :class:`JobError` and
carries its ``exit_code``, so the CLI can do ``except JobError as e: return e.exit_code``. Anything else
is judged by :func:`classify_exception` (rules in failures.py): 2 for what a person must fix (credentials,
permissions, a missing bucket, a read-only or wrong-kind path, MemoryError, a spec refused inside a Ray
actor), 75 only for what may pass by itself (timeouts, throttling, 5xx, resets, lost workers), else 1.
Job errors pickle with their fields, so they cross Ray's process boundary intact.

A row that cannot be processed is not fatal: it becomes one error row (id, stage, code, message) that is
committed in ``errors/`` atomically together with the rest of its part, exactly once. Messages must be
deterministic (no addresses, timings or random ids) because error objects are part of the byte-identical
output.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from deepinfer.pipeline.failures import first_line, flattened_error, must_fix, s3_code


class ExitCode(enum.IntEnum):
    """The CLI's exit codes (DESIGN.md's table); the only place they are defined."""

    OK = 0
    BUG = 1                 # an unexpected error: a bug in deepinfer
    USAGE = 2               # invalid spec or usage, or an environment a person must fix
    BUDGET = 3              # more rows quarantined than runtime.max_error_fraction allows
    OTHER_JOB = 4           # the output path holds another job (different fingerprint)
    VERIFY_MISMATCH = 5     # `verify` recomputed a row that differs from the committed one
    RETRY = 75              # transient failure: run the same command again (it resumes)


class JobError(Exception):
    """Base of the failures a job reports on purpose; ``exit_code`` is what the CLI exits with."""

    exit_code: int = ExitCode.BUG


class SpecError(JobError, ValueError):
    """An invalid job spec or usage: each entry of `problems` is one 'field.path: what is wrong' line."""

    exit_code = ExitCode.USAGE

    MAX_PROBLEM_CHARS = 500  # a problem quotes at most a prefix of a bad value, whatever produced it

    def __init__(self, problems: list[str]) -> None:
        limit = self.MAX_PROBLEM_CHARS
        self.problems = [p if len(p) <= limit else p[: limit - 1] + "…" for p in map(str, problems)]
        super().__init__("invalid job spec:\n  " + "\n  ".join(self.problems))

    def __reduce__(self) -> tuple:
        # Ray pickles exceptions raised in workers; the default (cls, args) would rebuild problems from
        # the joined message one character at a time.
        return type(self), (self.problems,)


class InputError(JobError, ValueError):
    """The input cannot be read as specified (a malformed file, not a row-level problem): exit 2."""

    exit_code = ExitCode.USAGE


class OutputPathError(JobError, ValueError):
    """output.path cannot be used for this job (another owner's files, a file, a root): exit 2."""

    exit_code = ExitCode.USAGE


class FingerprintMismatch(JobError):
    """The output path already holds a job with another fingerprint (exit 4 unless ``--restart``).

    ``differences`` is the human-readable list from ``output.fingerprint.diff_fingerprints``.
    """

    exit_code = ExitCode.OTHER_JOB

    def __init__(self, output_url: str, differences: list[str]) -> None:
        self.output_url = output_url
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"output {output_url} holds another job (different fingerprint):\n{lines}\n"
            "use another output path, or rerun with --restart to discard the existing output"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.output_url, self.differences)


class NumericsMismatch(JobError):
    """A deterministic job's part would be computed on another numerics stack than its committed parts
    (output/numerics.py): exit 4, as for another job's output (resume on that stack, or --restart)."""

    exit_code = ExitCode.OTHER_JOB


class MustFix(JobError):
    """A failure a person must fix, classified where it happened (a Ray worker: worker_errors.py): exit 2
    with the classifier's message."""

    exit_code = ExitCode.USAGE


class ErrorBudgetExceeded(JobError):
    """More rows failed than ``max_error_fraction`` allows (exit 3, after committing what succeeded)."""

    exit_code = ExitCode.BUDGET

    def __init__(self, error_rows: int, total_rows: int, max_error_fraction: float) -> None:
        self.error_rows = error_rows
        self.total_rows = total_rows
        self.max_error_fraction = max_error_fraction
        super().__init__(
            f"{error_rows} of {total_rows} rows failed, more than max_error_fraction={max_error_fraction}; "
            "the failed rows are in errors/ of the output"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.error_rows, self.total_rows, self.max_error_fraction)


class RetryableError(JobError):
    """An infrastructure failure worth retrying later with the same command (exit 75)."""

    exit_code = ExitCode.RETRY


class RetryableStorageError(RetryableError):
    """Storage unreachable, timing out, throttling or failing server-side (exit 75)."""


class Stage(str, enum.Enum):
    """Where in the pipeline a row failed."""

    READ = "read"
    PROMPT = "prompt"
    TOKENIZE = "tokenize"
    GENERATE = "generate"
    VALIDATE = "validate"


class ErrorCode(str, enum.Enum):
    """Why a row failed. Stable strings: users filter errors/ on them."""

    MISSING_COLUMN = "MISSING_COLUMN"  # a column the prompt needs is absent from the row
    NULL_VALUE = "NULL_VALUE"  # a column the prompt needs is null
    BAD_ROW = "BAD_ROW"  # the row could not be decoded (e.g. malformed JSONL line)
    TEMPLATE_ERROR = "TEMPLATE_ERROR"  # the jinja template raised while rendering this row
    EMPTY_PROMPT = "EMPTY_PROMPT"  # the rendered prompt is empty
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"  # prompt tokens (+ max_tokens) exceed the model's length
    TOKENIZER_ERROR = "TOKENIZER_ERROR"
    GENERATION_ERROR = "GENERATION_ERROR"  # the engine rejected or failed this one request
    INVALID_JSON = "INVALID_JSON"  # output_schema set but the text does not parse as JSON
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"  # parses, but does not validate against output_schema
    TRUNCATED = "TRUNCATED"  # output_schema set and generation hit max_tokens (finish_reason "length")
    DUPLICATE_ID = "DUPLICATE_ID"  # an earlier row (input order) has the same id; that one is processed
    BAD_FILE = "BAD_FILE"  # input.on_bad_file: quarantine, and this row's file cannot be read
    SCHEMA_VIOLATION = "SCHEMA_VIOLATION"  # output_schema_mode: validate, the answer breaks the full schema
    BAD_MESSAGES = "BAD_MESSAGES"  # prompt.messages_column / body.messages is not a {role, content} list
    BAD_CHOICES = "BAD_CHOICES"  # eval.choices_column is not a non-empty list of option strings
    BAD_REQUEST = "BAD_REQUEST"  # an OpenAI Batch line's method, url or body parameter cannot be honoured


@cache
def _error_schema() -> Any:
    import pyarrow as pa  # lazily: `deepinfer-job validate` imports this module and must stay light

    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("stage", pa.string(), nullable=False),
            pa.field("code", pa.string(), nullable=False),
            pa.field("message", pa.string(), nullable=False),
        ]
    )


def __getattr__(name: str) -> Any:
    # ERROR_SCHEMA: schema of the tables in errors/. ``id`` is the row id (id_column value as a string, or
    # "file:row"). Built on first use (PEP 562) so that importing the exit codes does not import pyarrow.
    if name == "ERROR_SCHEMA":
        return _error_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class ErrorRow:
    """One quarantined row. ``stage`` and ``code`` accept the enums or their string values."""

    id: str
    stage: str
    code: str
    message: str

    def __post_init__(self) -> None:
        stage = self.stage.value if isinstance(self.stage, Stage) else self.stage
        code = self.code.value if isinstance(self.code, ErrorCode) else self.code
        if stage not in {s.value for s in Stage}:
            raise ValueError(f"ErrorRow.stage must be one of {[s.value for s in Stage]}, got {stage!r}")
        if code not in {c.value for c in ErrorCode}:
            raise ValueError(f"ErrorRow.code must be one of {[c.value for c in ErrorCode]}, got {code!r}")
        if not isinstance(self.id, str):
            raise ValueError(f"ErrorRow.id must be a string (convert the id column value), got {self.id!r}")
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "message", str(self.message)[:MAX_MESSAGE_CHARS])


def error_table(rows: Iterable[ErrorRow]) -> Any:
    """The errors of one part as a pyarrow table with ERROR_SCHEMA, in the order given (input order)."""
    import pyarrow as pa

    rows = list(rows)
    return pa.table(
        {
            "id": pa.array([r.id for r in rows], pa.string()),
            "stage": pa.array([r.stage for r in rows], pa.string()),
            "code": pa.array([r.code for r in rows], pa.string()),
            "message": pa.array([r.message for r in rows], pa.string()),
        },
        schema=_error_schema(),
    )


@dataclass(frozen=True)
class ErrorBudget:
    """How many rows may fail before the job fails: at most ``max_error_fraction`` of all input rows.

    The budget is judged over the whole job (all parts, including those committed by earlier runs), so a
    resumed job reaches the same verdict as an uninterrupted one.
    """

    max_error_fraction: float = 0.01

    def __post_init__(self) -> None:
        f = self.max_error_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 <= f <= 1:
            raise ValueError(
                "runtime.max_error_fraction must be a number between 0 and 1, "
                f"got {self.max_error_fraction!r}"
            )

    def allowed_errors(self, total_rows: int) -> int:
        """The largest number of failed rows still within budget for a job of ``total_rows`` rows."""
        if total_rows < 0:
            raise ValueError(f"total_rows must be >= 0, got {total_rows}")
        # floor with a tolerance so that e.g. 0.07 * 100 (= 7.000000000000001) allows exactly 7
        return int(math.floor(self.max_error_fraction * total_rows + 1e-9))

    def exceeded(self, error_rows: int, total_rows: int) -> bool:
        """True when ``error_rows`` failures out of ``total_rows`` rows break the budget."""
        return error_rows > self.allowed_errors(total_rows)

    def check(self, error_rows: int, total_rows: int) -> None:
        """Raise :class:`ErrorBudgetExceeded` (exit 3) when the budget is broken."""
        if self.exceeded(error_rows, total_rows):
            raise ErrorBudgetExceeded(error_rows, total_rows, self.max_error_fraction)


# ---- classification of what ended a run --------------------------------------------------------
# The rule (DESIGN.md): 2 when a person must change something before a rerun can succeed (credentials,
# permissions, a missing bucket, a read-only or wrong-kind path, a corrupt input file, a refused model),
# 75 only when the very same command may succeed later (timeouts, throttling, 5xx, resets, lost workers),
# 1 for everything else, which is a bug in deepinfer.

def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        inner = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the user exception here
        exc = inner if isinstance(inner, BaseException) else (exc.__cause__ or exc.__context__)
    return chain


def _retryable_types() -> tuple[type, ...]:
    types: list[type] = [OSError, ConnectionError, TimeoutError]
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


def classify_exception(exc: BaseException) -> tuple[ExitCode, str]:
    """(exit code, message) for `exc`; looks through Ray's task-error wrappers at the original cause.

    The message is redacted by the spec's secret rule (URL userinfo, AWS key ids): it goes to the
    terminal, to logs and to `_FAILED`."""
    from deepinfer.pipeline.spec.secrets import redact_text

    code, message = _classify(exc)
    return code, redact_text(message)


_DECIDED = (ExitCode.USAGE, ExitCode.BUDGET, ExitCode.OTHER_JOB, ExitCode.RETRY)


def _verdict(kind: type, code: Any, text: str) -> tuple[ExitCode, str] | None:
    """The contract's verdict on a failure of type `kind` (exit code attribute `code`, message `text`)."""
    if issubclass(kind, InputError):
        return ExitCode.USAGE, f"invalid input: {text}"
    if issubclass(kind, FingerprintMismatch):
        return ExitCode.OTHER_JOB, f"output path holds another job: {text}"
    if issubclass(kind, RetryableError):
        return ExitCode.RETRY, f"retryable failure: {text} (run the same command again; it resumes)"
    if isinstance(code, int) and code in _DECIDED:
        return ExitCode(code), text
    return None


def _flattened_verdict(e: BaseException) -> tuple[ExitCode, str] | None:
    """The verdict on a JobError that reached the driver only as text inside a Ray wrapper (Ray Data
    re-raises a UDF's exception as a UserCodeException that does not keep it; an actor whose constructor
    raised keeps only the formatted traceback)."""
    found = flattened_error(e)
    kind = globals().get(found[0]) if found is not None else None
    if found is None or not (isinstance(kind, type) and issubclass(kind, JobError)):
        return None
    return _verdict(kind, kind.exit_code, found[1])


def _classify(exc: BaseException) -> tuple[ExitCode, str]:
    chain = _cause_chain(exc)
    for e in chain:
        verdict = _verdict(type(e), getattr(e, "exit_code", None), str(e))
        if verdict is not None:
            return verdict
    for e in chain:
        verdict = _flattened_verdict(e)
        if verdict is not None:
            return verdict
    # The S3 error response, when there is one, is the most specific account of what happened (s3fs
    # wraps it in a generic PermissionError/OSError); it decides alone.
    s3 = [e for e in chain if s3_code(e) is not None]
    for e in s3[:1] or chain:
        fix = must_fix(e)
        if fix is not None:
            return ExitCode.USAGE, fix
    retryable = _retryable_types()
    for e in chain:
        if isinstance(e, retryable):
            return ExitCode.RETRY, (f"retryable failure: {type(e).__name__}: {first_line(e)} "
                                    "(run the same command again; it resumes)")
    return ExitCode.BUG, f"unexpected error: {type(exc).__name__}: {first_line(exc)}"


