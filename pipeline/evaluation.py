"""The `eval:` section: per-row scores written into the parts, and the job's metrics.json.

Scores are a pure function of a committed row (its text and kept reference), computed when the part is
assembled, so they are part of the byte-identical output and resume like any other column. metrics.json
is computed from the committed parts once every part is in (before _SUCCESS), so it is the same bytes
whether the job ran in one go or was killed and resumed.

Metrics (schemas/job.schema.json has the user-facing wording): exact_match, contains, regex_match (an
extraction pattern), json_field_match (a dotted field of the text parsed as JSON), choice_loglikelihood
(the option of `choices_column` with the highest log-likelihood given the prompt is the reference; the
log-likelihoods come from the engine's prompt logprobs, see stages/choices.py). Each score is 1.0 or
0.0, or null when the row's reference is null (such rows are left out of n). The standard error is the
sample standard deviation (n - 1) over sqrt(n), null for n < 2.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SCORE_PREFIX = "score_"
LOGLIK_PREFIX = "loglik_"  # choice_loglikelihood: the per-option log-likelihoods, list<double>
CHOICE_METRIC = "choice_loglikelihood"
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class Metric:
    """One configured metric: its kind, its column name, and its pattern or field."""

    kind: str
    name: str
    pattern: str | None = None
    field: str | None = None

    @property
    def column(self) -> str:
        return SCORE_PREFIX + self.name


@dataclass(frozen=True)
class EvalSpec:
    """The validated `eval:` section."""

    reference_column: str
    metrics: tuple[Metric, ...]
    normalize: tuple[str, ...]
    group_by: str | None
    choices_column: str | None = None

    @classmethod
    def from_document(cls, section: dict) -> EvalSpec:
        metrics = []
        for item in section["metrics"]:
            item = {"metric": item} if isinstance(item, str) else item
            metrics.append(Metric(item["metric"], item.get("name") or item["metric"], item.get("pattern"),
                                  item.get("field")))
        return cls(section["reference_column"], tuple(metrics), tuple(section.get("normalize") or ()),
                   section.get("group_by"), section.get("choices_column"))

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Input columns the scores need in the parts (kept automatically)."""
        return tuple(c for c in (self.reference_column, self.group_by, self.choices_column) if c)

    @property
    def score_columns(self) -> tuple[str, ...]:
        """Every column the eval adds to the parts (score_*, and loglik_* of choice metrics)."""
        cols: list[str] = []
        for m in self.metrics:
            cols += [m.column, LOGLIK_PREFIX + m.name] if m.kind == CHOICE_METRIC else [m.column]
        return tuple(cols)

    @property
    def needs_loglikelihoods(self) -> bool:
        return any(m.kind == CHOICE_METRIC for m in self.metrics)


def eval_problems(section: Any) -> list[str]:
    """What the schema cannot say about `eval:`: patterns compile, fields given, names unique."""
    if not isinstance(section, dict):
        return []
    problems, names = [], []
    for i, item in enumerate(section.get("metrics") or ()):
        item = {"metric": item} if isinstance(item, str) else item
        where = f"eval.metrics[{i}]"
        kind = item.get("metric")
        if kind == "regex_match":
            if "pattern" not in item:
                problems.append(f"{where}: regex_match needs a pattern (the extraction regex)")
            else:
                try:
                    re.compile(item["pattern"])
                except re.error as exc:
                    problems.append(f"{where}.pattern: not a valid regular expression: {exc}")
        elif "pattern" in item:
            problems.append(f"{where}.pattern: only regex_match takes a pattern")
        if kind == "json_field_match" and "field" not in item:
            problems.append(f"{where}: json_field_match needs a field (a dotted path into the JSON text)")
        elif kind != "json_field_match" and "field" in item:
            problems.append(f"{where}.field: only json_field_match takes a field")
        names.append(item.get("name") or kind)
    has_choice = any((m if isinstance(m, str) else m.get("metric")) == CHOICE_METRIC
                     for m in section.get("metrics") or ())
    if has_choice and not section.get("choices_column"):
        problems.append("eval.choices_column: choice_loglikelihood needs the input column that holds each "
                        "row's options (a list of strings)")
    elif section.get("choices_column") and not has_choice:
        problems.append("eval.choices_column: only used by the choice_loglikelihood metric; add it to "
                        "eval.metrics or remove choices_column")
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"eval.metrics: two metrics are named {name!r}; give each a unique `name`")
    return problems


def normalizer(steps: tuple[str, ...]) -> Callable[[str], str]:
    """The text normalization of `eval.normalize`, applied in the order given."""
    def apply(text: str) -> str:
        for step in steps:
            if step == "strip":
                text = text.strip()
            elif step == "lowercase":
                text = text.lower()
            elif step == "punctuation":
                text = text.translate(_PUNCTUATION)
        return text
    return apply


def _json_field(text: str, path: str) -> Any:
    try:
        value: Any = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


class Scorer:
    """Scores rows of one job: `score(text, reference)` -> one value per metric."""

    def __init__(self, spec: EvalSpec) -> None:
        self.spec = spec
        self.norm = normalizer(spec.normalize)
        self.patterns = {m.name: re.compile(m.pattern) for m in spec.metrics if m.pattern is not None}

    def _one(self, metric: Metric, text: str, ref: str) -> float:
        if metric.kind == "exact_match":
            return float(self.norm(text) == ref)
        if metric.kind == "contains":
            return float(ref in self.norm(text))
        if metric.kind == "regex_match":
            found = self.patterns[metric.name].search(text)
            if found is None:
                return 0.0
            extracted = found.group(1) if found.re.groups else found.group(0)
            return float(extracted is not None and self.norm(extracted) == ref)
        value = _json_field(text, str(metric.field))
        return float(value is not None and self.norm(_as_text(value)) == ref)

    def _choice(self, reference: Any, choices: Any, logliks: list[float] | None) -> float | None:
        """1.0 when the most likely option (the first of equals) is the reference: an int is an option's
        index, anything else is compared as normalized text; None when the reference names no option."""
        if not logliks or not isinstance(choices, list) or len(choices) != len(logliks):
            return None
        if isinstance(reference, int) and not isinstance(reference, bool):
            want = reference if 0 <= reference < len(choices) else None
        else:
            ref = self.norm(_as_text(reference))
            want = next((i for i, c in enumerate(choices) if self.norm(_as_text(c)) == ref), None)
        if want is None:
            return None
        best = max(range(len(logliks)), key=lambda i: (logliks[i], -i))
        return float(best == want)

    def score(self, text: str | None, reference: Any, choices: Any = None,
              logliks: list[float] | None = None) -> list[float | None]:
        if reference is None:
            return [None] * len(self.spec.metrics)
        ref = self.norm(_as_text(reference))
        return [self._choice(reference, choices, logliks) if m.kind == CHOICE_METRIC
                else self._one(m, text or "", ref) for m in self.spec.metrics]

    def columns(self, texts: list[str | None], references: list[Any], choices: list[Any] | None = None,
                logliks: list[list[float] | None] | None = None) -> list[tuple[str, Any]]:
        """(column name, pyarrow array) for a part's rows: score_<name> (float64) per metric, and for
        choice_loglikelihood also loglik_<name> (list<double>, the options' log-likelihoods)."""
        import pyarrow as pa  # here, not at the top: spec validation imports this module and no pyarrow

        n = len(texts)
        choices = choices if choices is not None else [None] * n
        logliks = logliks if logliks is not None else [None] * n
        scores = [self.score(*args) for args in zip(texts, references, choices, logliks)]
        out: list[tuple[str, Any]] = []
        for i, m in enumerate(self.spec.metrics):
            out.append((m.column, pa.array([s[i] for s in scores], type=pa.float64())))
            if m.kind == CHOICE_METRIC:
                out.append((LOGLIK_PREFIX + m.name, pa.array(logliks, type=pa.list_(pa.float64()))))
        return out


def summarize(values: list[float]) -> dict[str, Any]:
    """n, mean and standard error of the mean of scores (None values already left out)."""
    n = len(values)
    mean = math.fsum(values) / n if n else None
    stderr = None
    if n >= 2 and mean is not None:
        var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
        stderr = math.sqrt(var) / math.sqrt(n)
    return {"n": n, "mean": mean, "stderr": stderr}


def job_metrics(spec: EvalSpec, rows: Any, error_rows: int) -> dict[str, Any]:
    """metrics.json of a job from its committed result rows (a pyarrow Table) and its count of
    quarantined rows."""
    out: dict[str, Any] = {"rows": rows.num_rows, "error_rows": error_rows, "metrics": {}}
    groups = (rows.column(spec.group_by).to_pylist() if spec.group_by and rows.num_rows else None)
    for m in spec.metrics:
        scores = rows.column(m.column).to_pylist() if rows.num_rows else []
        entry = summarize([s for s in scores if s is not None])
        if groups is not None:
            by: dict[str, list[float]] = {}
            for g, s in zip(groups, scores):
                if s is not None:
                    by.setdefault(_as_text(g), []).append(s)
            entry["groups"] = {g: summarize(v) for g, v in sorted(by.items())}
        out["metrics"][m.name] = entry
    return out


def write_metrics(spec: EvalSpec, store: Any) -> None:
    """metrics.json of an `eval:` job from the committed parts of `store` (output/job_store.JobStore),
    written before _SUCCESS (so a complete job always has it, the same bytes however the run went)."""
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import METRICS_FILE, dumps

    metrics = job_metrics(spec, store.store.read_committed(), store.committed_error_rows())
    storage.write_atomic(store.store.fs, store.store.path(METRICS_FILE), dumps(metrics))
