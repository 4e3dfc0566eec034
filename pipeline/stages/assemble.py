"""Turning one part's engine results into its output rows and its quarantined errors.

Column types come from the spec (and, for kept Parquet columns, from the input files' schemas), never from
whichever values happen to be in the part, and rows are ordered by their input position: the same rows
always give the same tables, hence the same file bytes.

Output row columns, in order: the id column, text, finish_reason, prompt_tokens, output_tokens, seed, then
`sample_index` (int64; sampling.n > 1 or Batch input: one row per sample, `seed` the sample's own),
`logprobs` and `prompt_logprobs` (sampling.logprobs / prompt_logprobs set, or Batch input for logprobs;
engine_rows.LOGPROBS_TYPE), the kept input columns, then with an output_schema `json` (canonical JSON
text) and one typed column per top-level property. `output.format: openai_batch` writes Batch API lines
instead (openai_batch_output.py). Error rows (errors.ERROR_SCHEMA): id, stage, code, message.

Ids: a row id is compared (duplicates, seeds) in its canonical text form, so 7 and "7" are one id. The
output id column keeps an integer or string type only where the whole input agrees on it (Parquet files
with one id type); JSONL input, which has no schema, and mixed types always get a string column, so the
column's type never depends on which rows a part happens to hold.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.errors import ERROR_SCHEMA, MAX_MESSAGE_CHARS
from deepinfer.pipeline.spec.output_columns import arrow_type, column_kinds, column_value
from deepinfer.pipeline.stages import columns as C

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
                 OverflowError)


def _as_text(values: list[Any]) -> pa.Array:
    """The last resort for values of mixed types: strings as they are, anything else as JSON text."""
    return pa.array([v if v is None or isinstance(v, str) else C.dumps(v) for v in values], type=pa.string())


def _typed_array(values: list[Any], type_: pa.DataType | None) -> pa.Array:
    """Values as an array of `type_` when given (falling back to inference, then to text, when they do
    not fit: a part must always be assemblable, whatever mix of types its rows hold)."""
    if type_ is not None:
        try:
            return pa.array(values, type=type_)
        except _ARROW_ERRORS:
            try:  # ISO datetimes / decimal strings carried as JSON text
                return pa.array(values).cast(type_)
            except _ARROW_ERRORS:
                pass
    try:
        return pa.array(values)
    except _ARROW_ERRORS:
        return _as_text(values)


def id_type(found: pa.DataType | None) -> pa.DataType:
    """The output id column's type: an integer or string type the whole input agrees on, else string."""
    if found is not None and (pa.types.is_integer(found) or pa.types.is_string(found)
                              or pa.types.is_large_string(found)):
        return found
    return pa.string()


class PartAssembler:
    """Builds (rows, errors) tables for a part from its ENGINE_SCHEMA rows."""

    def __init__(self, id_column: str, derived_id: bool, keep_columns: tuple[str, ...],
                 output_schema: dict | None, keep_types: dict[str, pa.DataType] | None = None,
                 scorer: Any = None, samples: bool = False, logprobs: bool = False,
                 prompt_logprobs: bool = False, batch_output: Any = None) -> None:
        self.id_column, self.keep = id_column, keep_columns
        self.samples, self.logprobs, self.prompt_logprobs = samples, logprobs, prompt_logprobs
        self.batch_output = batch_output  # openai_batch_output.BatchOutput for output.format openai_batch
        self.scorer = scorer  # evaluation.Scorer of an `eval:` job: score_* columns after the rest
        self.keep_types = dict(keep_types or {})
        self.keep_types[id_column] = pa.string() if derived_id else id_type(self.keep_types.get(id_column))
        self.schema_kinds = column_kinds(output_schema) if output_schema is not None else None

    def build(self, results: pa.Table) -> tuple[pa.Table, pa.Table]:
        """Order by input position, then split into output rows and errors."""
        results = results.sort_by([("__file", "ascending"), ("__row", "ascending")])
        rows = results.to_pylist()
        ok = [r for r in rows if r["__err_stage"] is None]
        bad = [r for r in rows if r["__err_stage"] is not None]
        if self.batch_output is not None:
            return self.batch_output.table(ok), self._errors_table(bad)
        return self._rows_table(_per_sample(ok)), self._errors_table(bad)

    def _errors_table(self, bad: list[dict]) -> pa.Table:
        return C.table({
            "id": [r["__row_id"] for r in bad], "stage": [r["__err_stage"] for r in bad],
            "code": [r["__err_code"] for r in bad],
            "message": [(r["__err_msg"] or "")[:MAX_MESSAGE_CHARS] for r in bad],
        }, ERROR_SCHEMA)

    def _rows_table(self, ok: list[dict]) -> pa.Table:
        kept = [C.loads(r["__keep"]) for r in ok]
        names: list[str] = [self.id_column]
        ids = [k.get(self.id_column) for k in kept]
        id_type_ = self.keep_types[self.id_column]
        if pa.types.is_string(id_type_) or pa.types.is_large_string(id_type_):
            ids = [None if v is None else str(v) for v in ids]  # the canonical text form
        arrays: list[pa.Array] = [_typed_array(ids, id_type_)]
        fixed = [("text", "__text", pa.string()), ("finish_reason", "__finish", pa.string()),
                 ("prompt_tokens", "__plen", pa.int64()), ("output_tokens", "__ntok", pa.int64()),
                 ("seed", "__seed", pa.int64())]
        for name, src, type_ in fixed:
            names.append(name)
            arrays.append(pa.array([r[src] for r in ok], type=type_))
        from deepinfer.pipeline.stages.engine_rows import LOGPROBS_TYPE

        for name, src, type_, on in (("sample_index", "__sample", pa.int64(), self.samples),
                                     ("logprobs", "__logprobs", LOGPROBS_TYPE, self.logprobs),
                                     ("prompt_logprobs", "__plp", LOGPROBS_TYPE, self.prompt_logprobs)):
            if on:
                names.append(name)
                arrays.append(pa.array([r[src] for r in ok], type=type_))
        for col in self.keep:
            if col == self.id_column:
                continue
            names.append(col)
            arrays.append(_typed_array([k.get(col) for k in kept], self.keep_types.get(col)))
        if self.schema_kinds is not None:
            names.append("json")
            arrays.append(pa.array([r["__json"] for r in ok], type=pa.string()))
            parsed = [json.loads(r["__json"]) for r in ok]
            for prop, kind in self.schema_kinds:
                names.append(prop)
                values = [column_value(kind, p.get(prop)) if isinstance(p, dict) else None for p in parsed]
                arrays.append(pa.array(values, type=arrow_type(kind)))
        if self.scorer is not None:
            ref = self.scorer.spec.reference_column
            refs = [k.get(ref) for k in kept]
            choices_col = self.scorer.spec.choices_column
            choices = [k.get(choices_col) for k in kept] if choices_col else None
            logliks = [r["__loglik"] for r in ok] if choices_col else None
            for name, array in self.scorer.columns([r["__text"] for r in ok], refs, choices, logliks):
                names.append(name)
                arrays.append(array)
        return pa.Table.from_arrays(arrays, names=names)


def _per_sample(ok: list[dict]) -> list[dict]:
    """Engine rows -> output rows: one per sample (__extra "samples"), with its logprobs, the row's prompt
    logprobs and option log-likelihoods; a row without samples is its sample 0."""
    out = []
    for r in ok:
        extra = json.loads(r["__extra"]) if r.get("__extra") else {}
        shared = {"__plp": extra.get("prompt_logprobs"), "__loglik": extra.get("loglik")}
        samples = extra.get("samples")
        if not samples:
            out.append({**r, **shared, "__sample": 0, "__logprobs": None})
            continue
        for index, s in enumerate(samples):
            out.append({**r, **shared, "__sample": index, "__logprobs": s["logprobs"], "__text": s["text"],
                        "__finish": s["finish"], "__ntok": s["ntok"], "__seed": s["seed"],
                        "__json": s["json"]})
    return out


def keep_types_from_parquet(listing: list, columns: list[str]) -> dict[str, pa.DataType]:
    """Unified Arrow types of `columns` across the input Parquet files' schemas, as the listing read them
    from each footer (stages/read.py list_input)."""
    if not columns:
        return {}
    # on_bad_file: quarantine listed an unreadable file with no schema; its rows become BAD_FILE errors.
    schemas = [f.schema for f in listing if f.bad is None]
    types: dict[str, pa.DataType] = {}
    for col in columns:
        fields = [s.field(col) for s in schemas if col in s.names]
        if not fields:
            continue
        try:
            unified = pa.unify_schemas([pa.schema([f]) for f in fields], promote_options="permissive")
            types[col] = unified.field(col).type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            types[col] = pa.string()
    return types


def jsonl_sample(listing: list, storage_options: dict | None, sample_rows: int = 1000) -> list[dict | None]:
    """The input's first `sample_rows` JSONL rows (None for a line that is not a JSON object), skipping an
    unreadable file (on_bad_file: quarantine): the one read that the kept columns' types and presence are
    judged on."""
    from deepinfer.pipeline.stages.read import read_rows

    rows: list[dict | None] = []
    for f in listing:
        take = min(f.num_rows, sample_rows - len(rows))
        if take <= 0:
            break
        if getattr(f, "bad", None):  # an unreadable file has no values
            continue
        rows += [row for row, _ in read_rows(f.url, "jsonl", 0, take, storage_options, f.offset_of(0))]
    return rows


def keep_types_from_jsonl(sample: list[dict | None], columns: list[str],
                          id_column: str | None = None) -> dict[str, pa.DataType]:
    """Arrow types for kept JSONL columns, inferred once from the input's first rows (`sample`, read by
    `jsonl_sample`; the same read judges the columns' presence).

    JSON has no schema, so the job fixes one from a sample that depends only on the input: every part
    (also an empty one, also on resume) then gets the same column types. Columns that are null throughout
    the sample are strings; values that do not fit the type fall back to inference for their part. The id
    column is always a string column: a sample cannot promise that no later row has a string id.
    """
    types = {}
    for c in columns:
        try:
            type_ = pa.array([row.get(c) if row is not None else None for row in sample]).type
        except _ARROW_ERRORS:
            type_ = pa.string()
        types[c] = pa.string() if pa.types.is_null(type_) or c == id_column else type_
    return types


def absent_columns(listing: list, fmt: str, columns: list[str], storage_options: dict | None,
                   sample: list[dict | None] | None = None) -> list[str]:
    """The `columns` no input row has: in no Parquet file's schema, or the key of no row of the JSONL
    sample (`jsonl_sample`, or `sample`); none for an empty JSONL input. A kept column that no row has is a
    typo (it would be written as nulls, and an eval scored on it would score nothing), so the job refuses
    it up front."""
    if fmt == "parquet":
        schemas = [f.schema for f in listing if f.bad is None]
        return [c for c in columns if schemas and not any(c in s.names for s in schemas)]
    if fmt != "jsonl":
        return []
    rows = jsonl_sample(listing, storage_options) if sample is None else sample
    return [c for c in columns if rows and not any(row is not None and c in row for row in rows)]


def _refuse_absent(spec, absent: list[str]) -> None:
    """SpecError naming the field of every kept column of `spec` (a JobSpec: output.keep_columns, or the
    eval's reference / group / choices column) in `absent`."""
    from deepinfer.pipeline.errors import SpecError

    if not absent:
        return
    ev = spec.eval
    fields = {} if ev is None else {c: f"eval.{name}" for name, c in (
        ("reference_column", ev.reference_column), ("group_by", ev.group_by),
        ("choices_column", ev.choices_column)) if c}
    raise SpecError([f"{fields.get(c, 'output.keep_columns')}: no input row has a column {c!r} (check its "
                     f"spelling against input {spec.input.path})" for c in absent])


def keep_types_for(spec, listing: list) -> dict[str, pa.DataType]:
    """The Arrow types of the id column and the kept columns of `spec`'s job (a JobSpec), from the Parquet
    footers or one JSONL sample; SpecError first for a kept column no input row has."""
    cols = [c for c in (spec.input.id_column, *spec.output.keep_columns) if c]
    keep, fmt, options = list(spec.output.keep_columns), spec.input.format, spec.input.storage_options
    if fmt == "parquet":
        _refuse_absent(spec, absent_columns(listing, fmt, keep, options))
        return keep_types_from_parquet(listing, cols)
    sample = jsonl_sample(listing, options) if cols else []
    _refuse_absent(spec, absent_columns(listing, fmt, keep, options, sample))
    return keep_types_from_jsonl(sample, cols, id_column=spec.input.id_column)
