"""CPU stages before the engine: read a part, render prompts, tokenize and length-sort.

Each stage is a plain callable over pyarrow Tables (fixed schemas from columns.py), so Ray Data runs it in
map_batches and the local executor calls it in-process: both executors run exactly the same code.
A row that cannot be prompted or tokenized is not dropped: it carries its error (stage, code, message) to
the end of the pipeline, where the driver quarantines it in errors/ exactly once.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.errors import InputError, SpecError
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.read import read_rows


def read_part_table(part: dict, fmt: str, storage_options: dict | None, on_bad_file: str = "fail"
                    ) -> pa.Table:
    """One part (a row range of one file) as a READ_SCHEMA table: location columns + the row as JSON.

    A line that cannot be decoded stays in the table as a quarantined row (stage 'read', code BAD_ROW).
    Rows listed in the part's ``duplicates`` (row indices whose id an earlier row of the job already has,
    see dedupe.py) keep their input, so their id is known, and are quarantined with code DUPLICATE_ID.
    A file that cannot be decoded raises InputError (exit 2), or with `on_bad_file` 'quarantine' turns
    every row of the part into a BAD_FILE error naming the file.
    """
    first, rel, n = part["first_row"], part["relpath"], part["num_rows"]
    bad_file: str | None = None
    try:
        rows = read_rows(part["url"], fmt, first, n, storage_options, part.get("offset"))
    except InputError as exc:
        if on_bad_file != "quarantine":
            raise
        bad_file, rows = str(exc), [(None, str(exc))] * n
    duplicates = set(part.get("duplicates") or ())
    codes: list[str | None] = []
    messages: list[str | None] = []
    for i, (_, problem) in enumerate(rows):
        if bad_file is not None:
            codes.append("BAD_FILE")
            messages.append(bad_file)
        elif problem is not None:
            codes.append("BAD_ROW")
            messages.append(problem)
        elif first + i in duplicates:
            codes.append("DUPLICATE_ID")
            messages.append("an earlier row of the input (sorted file paths, then row order) has the same "
                            "id; only that first row is processed")
        else:
            codes.append(None)
            messages.append(None)
    return C.table({
        "__part": [part["part_id"]] * len(rows),
        "__file": [part["file_index"]] * len(rows),
        "__row": list(range(first, first + len(rows))),
        "__source": [f"{rel}:{first + i}" for i in range(len(rows))],
        "__input": [C.dumps(r) if r is not None else None for r, _ in rows],
        "__err_stage": [None if code is None else "read" for code in codes],
        "__err_code": codes,
        "__err_msg": messages,
    }, C.READ_SCHEMA)


class ReadStage:
    """Ray Data stage: a batch of part descriptors -> the rows of those parts (READ_SCHEMA)."""

    def __init__(self, fmt: str, storage_options: dict | None, on_bad_file: str = "fail") -> None:
        self.fmt, self.storage_options, self.on_bad_file = fmt, storage_options, on_bad_file

    def __call__(self, batch: pa.Table) -> pa.Table:
        parts = [json.loads(p) for p in batch.column("part").to_pylist()]
        tables = [read_part_table(p, self.fmt, self.storage_options, self.on_bad_file) for p in parts]
        return pa.concat_tables(tables) if tables else C.READ_SCHEMA.empty_table()


class _NullValue(Exception):
    pass


def _finalize(value: Any) -> Any:
    # Printing a null column would silently put "None" in the prompt: make it a row error instead.
    if value is None:
        raise _NullValue()
    return value


def row_id_of(row: dict, id_column: str | None, source: str) -> tuple[str, Any, tuple[str, str] | None]:
    """(row id used for the seed and errors/, the id value written to the output, (code, message) or None).

    A row whose id is missing or unusable keeps its source ('relpath:row') as row id and is quarantined
    with stage 'read'.
    """
    if id_column is None:
        return source, source, None
    value = row.get(id_column)
    if value is None:
        return source, None, ("MISSING_COLUMN", f"id column {id_column!r} is missing or null")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return source, None, ("BAD_ROW", f"id column {id_column!r} must be a string or an integer, "
                                         f"got {type(value).__name__}")
    return str(value), value, None


class PromptStage:
    """Render prompt.template (and prompt.system) over each row's columns in a jinja2 sandbox; or take the
    row's conversation from prompt.messages_column, or from an OpenAI Batch line's body (`batch_input`).

    StrictUndefined makes a missing column an error; printing a null value is an error too. Both
    quarantine the row with stage 'prompt' (codes MISSING_COLUMN, NULL_VALUE, TEMPLATE_ERROR); malformed
    messages, choices or Batch bodies too (BAD_MESSAGES, BAD_CHOICES, BAD_REQUEST: stages/requests.py).
    What a row asks beyond its text travels in __aux (columns.py).
    """

    def __init__(self, template: str | None, system: str | None, id_column: str | None,
                 keep_columns: list[str] | tuple[str, ...], output_id_column: str,
                 messages_column: str | None = None, choices_column: str | None = None,
                 batch_input: bool = False) -> None:
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, finalize=_finalize,
                                            keep_trailing_newline=True)
        self.template = env.from_string(template) if template is not None else None
        self.system = env.from_string(system) if system is not None else None
        self.id_column, self.keep = id_column, list(keep_columns)
        self.output_id_column = output_id_column
        self.messages_column, self.choices_column = messages_column, choices_column
        self.batch_input = batch_input

    def _request(self, row: dict) -> tuple[str | None, str | None, str | None, tuple[str, str, str] | None]:
        """(user text, system text, __aux JSON, error) of a valid row."""
        from deepinfer.pipeline.stages.requests import parse_batch_request, parse_choices, parse_messages

        aux: dict[str, Any] = {}
        user = system = None
        if self.batch_input:
            request, problem = parse_batch_request(row)
            aux = request or {}
        elif self.messages_column is not None:
            messages, problem = parse_messages(row.get(self.messages_column),
                                               f"column {self.messages_column!r}")
            aux["messages"] = messages
        else:
            user, system, err = self._render(row)
            if err is not None:
                return None, None, None, err
            problem = None
        if problem is None and self.choices_column is not None:
            aux["choices"], problem = parse_choices(row.get(self.choices_column),
                                                    f"column {self.choices_column!r}")
        if problem is not None:
            return None, None, None, ("prompt", *problem)
        return user, system, (C.dumps(aux) if aux else None), None

    def _render(self, row: dict) -> tuple[str | None, str | None, tuple[str, str, str] | None]:
        from jinja2 import UndefinedError

        assert self.template is not None
        try:
            user = self.template.render(**row)
            system = self.system.render(**row) if self.system is not None else None
            return user, system, None
        except UndefinedError as exc:
            message = f"template refers to a missing column: {exc.message}"
            return None, None, ("prompt", "MISSING_COLUMN", message)
        except _NullValue:
            return None, None, ("prompt", "NULL_VALUE", "template prints a column whose value is null")
        except Exception as exc:  # the sandbox raises SecurityError, TypeError, ... for bad templates/values
            return None, None, ("prompt", "TEMPLATE_ERROR", f"{type(exc).__name__}: {exc}")

    def __call__(self, batch: pa.Table) -> pa.Table:
        out: dict[str, list] = {f.name: [] for f in C.PROMPT_SCHEMA}
        for loc in C.LOCATION:
            out[loc[0]] = batch.column(loc[0]).to_pylist()
        earlier = zip(*(batch.column(n).to_pylist() for n in ("__err_stage", "__err_code", "__err_msg")))
        for source, text, read_error in zip(out["__source"], batch.column("__input").to_pylist(), earlier):
            aux = None
            if read_error[0] is not None and text is not None:  # a duplicate id: named by its id
                row_id, _, _ = row_id_of(C.loads(text), self.id_column, source)
                user, system, err, keep = None, None, read_error, {self.output_id_column: None}
            elif read_error[0] is not None:  # undecodable line: keep its location as id, pass the error on
                user, system, err = None, None, read_error
                row_id, keep = source, {self.output_id_column: None}
            else:
                row = C.loads(text)
                row_id, id_value, id_error = row_id_of(row, self.id_column, source)
                keep = {self.output_id_column: id_value, **{c: row.get(c) for c in self.keep}}
                if id_error is None:
                    user, system, aux, err = self._request(row)
                else:
                    user, system, err = None, None, ("read", *id_error)
            out["__row_id"].append(row_id)
            out["__keep"].append(C.dumps(keep))
            out["__user"].append(user)
            out["__system"].append(system)
            out["__aux"].append(aux)
            out["__err_stage"].append(err[0] if err else None)
            out["__err_code"].append(err[1] if err else None)
            out["__err_msg"].append(err[2] if err else None)
        return C.table(out, C.PROMPT_SCHEMA)


def model_max_len(model_dir: str | Path, configured: int | None) -> int:
    """The engine's max_model_len: the spec's value, else config.json's max_position_embeddings."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError([f"model: {model_dir} has no config.json (a model directory needs a Hugging Face "
                         "config.json)"]) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError([f"model: {path} is not valid JSON ({exc})"]) from None
    if not isinstance(config, dict):
        raise SpecError([f"model: {path} must hold a JSON object, not a {type(config).__name__}"])
    limit = config.get("max_position_embeddings")
    limit = limit or config.get("text_config", {}).get("max_position_embeddings")
    if configured is not None:
        return min(configured, limit) if limit else configured
    if not limit:
        raise ValueError(f"{model_dir}/config.json has no max_position_embeddings: set model.max_model_len")
    return int(limit)


class TokenizeStage:
    """Chat-template (chat mode) and encode prompts; check their length; sort the window by length.

    The batch this stage receives is one sort window (runtime.sort_window rows): it returns the rows
    ordered by (prompt length, file, row), so the engine batches cut from it hold similar lengths.
    A prompt with max_model_len tokens or more is quarantined here (stage 'tokenize', code PROMPT_TOO_LONG).
    """

    def __init__(self, model_dir: str, mode: str, max_model_len: int, chat_date: str) -> None:
        from deepinfer.engine.text.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.mode, self.max_model_len = mode, max_model_len
        self.now = _dt.datetime.combine(_dt.date.fromisoformat(chat_date), _dt.time())

    def _text(self, user: str | None, system: str | None, aux: dict) -> str:
        if aux.get("messages") is not None:  # prompt.messages_column / a Batch body: the whole conversation
            return self.tokenizer.apply_chat_template(aux["messages"], add_generation_prompt=True,
                                                      now=self.now)
        if self.mode == "raw":
            return str(user)
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, now=self.now)

    def _choices(self, cols: dict[str, list], i: int, text: str, aux: dict) -> None:
        """Each choice_loglikelihood option's request ids (stages/choices.py) into the row's __aux."""
        from deepinfer.pipeline.stages.choices import option_requests

        made = option_requests(self.tokenizer, text, aux["choices"], self.mode == "raw")
        if isinstance(made, str):
            self._fail(cols, i, "BAD_CHOICES", made)
            return
        ids, starts = made
        longest = max(len(x) for x in ids)
        if longest >= self.max_model_len:
            self._fail(cols, i, "PROMPT_TOO_LONG", f"prompt + option has {longest} tokens; "
                                                   f"max_model_len={self.max_model_len}")
            return
        cols["__aux"][i] = C.dumps({**aux, "choice_ids": ids, "choice_ctx": starts})

    def __call__(self, batch: pa.Table) -> pa.Table:
        cols = {name: batch.column(name).to_pylist() for name in C.PROMPT_SCHEMA.names}
        n = batch.num_rows
        texts: dict[int, str] = {}
        for i in range(n):
            if cols["__err_stage"][i] is not None:
                continue
            aux = C.loads(cols["__aux"][i]) if cols["__aux"][i] else {}
            try:
                texts[i] = self._text(cols["__user"][i], cols["__system"][i], aux)
            except ValueError as exc:
                self._fail(cols, i, "TEMPLATE_ERROR", f"chat template: {exc}")
                continue
            if aux.get("choices"):
                self._choices(cols, i, texts[i], aux)
                if cols["__err_stage"][i] is not None:
                    del texts[i]
        order = sorted(texts)
        # The rendered chat text already holds bos; raw prompts get the tokenizer's usual special tokens.
        encoded = self.tokenizer.encode_batch([texts[i] for i in order],
                                              add_special_tokens=self.mode == "raw")
        ids: list[list[int] | None] = [None] * n
        for i, toks in zip(order, encoded):
            if not toks:
                self._fail(cols, i, "EMPTY_PROMPT", "the prompt encodes to zero tokens")
            elif len(toks) >= self.max_model_len:
                self._fail(cols, i, "PROMPT_TOO_LONG",
                           f"prompt has {len(toks)} tokens; max_model_len={self.max_model_len} "
                           "leaves no room to generate")
            else:
                ids[i] = toks
        cols["__ids"] = ids
        cols["__plen"] = [len(t) if t else 0 for t in ids]
        table = C.table(cols, C.TOKENIZE_SCHEMA)
        keys = sorted(range(n), key=lambda i: (cols["__plen"][i], cols["__file"][i], cols["__row"][i]))
        return table.take(pa.array(keys, type=pa.int64()))

    @staticmethod
    def _fail(cols: dict[str, list], i: int, code: str, message: str) -> None:
        cols["__err_stage"][i], cols["__err_code"][i], cols["__err_msg"][i] = "tokenize", code, message
