"""The engine stage: one deepinfer.engine.LLM per actor, generating for a batch of tokenized rows.

Each row is sampled with its own seed, derive_seed(job seed, row id), and the engine is batch-invariant,
so a row's output does not depend on the batch it lands in. With an output_schema the text is parsed and
validated with jsonschema; rows that fail (or hit max_tokens) are quarantined, not written as results.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.stages import columns as C


def _validate_output(text: str, finish: str, validator) -> tuple[str | None, tuple[str, str, str] | None]:
    """(canonical JSON text, None) or (None, (stage, code, message)) for a constrained row."""
    if finish == "length":
        return None, ("generate", "TRUNCATED", "output hit sampling.max_tokens before the JSON was complete")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, ("validate", "INVALID_JSON", f"output is not valid JSON: {exc.msg} at char {exc.pos}")
    error = next(iter(validator.iter_errors(value)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return None, ("validate", "SCHEMA_MISMATCH", f"output does not match output_schema at {where}: "
                                                      f"{error.message}")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None


# Test hook: with this set to 1 in the submitting process, engines are StubLLMs (no model, no torch), so
# tests can push many rows through the real driver, stages and commits in seconds. A no-op unless set.
STUB_ENGINE_ENV = "DEEPINFER_TEST_STUB_ENGINE"


def _build_llm(model_ref: str, engine_kwargs: dict[str, Any]) -> Any:
    from deepinfer.engine import LLM

    return LLM(model=model_ref, **engine_kwargs)


# Engines kept for reuse while a sweep runs its points in this process (None: no sharing, the default).
_shared: dict[str, Any] | None = None


@contextlib.contextmanager
def shared_engines() -> Iterator[None]:
    """Within this block, stages of one process that ask for the same model and engine settings share
    one LLM: a sweep's points build their model once. Safe for the output bytes: a row depends only on its
    own prompt, parameters and seed (batch-invariant engine), not on what the engine ran before."""
    global _shared
    outer = _shared
    _shared = {} if outer is None else outer
    try:
        yield
    finally:
        _shared = outer


def _load_llm(model_ref: str, engine_kwargs: dict[str, Any]) -> Any:
    if _shared is None:
        return _build_llm(model_ref, engine_kwargs)
    key = json.dumps([model_ref, engine_kwargs], sort_keys=True, default=str)
    if key not in _shared:
        _shared[key] = _build_llm(model_ref, engine_kwargs)
    return _shared[key]


@dataclass(frozen=True)
class _StubOutput:
    text: str
    token_ids: list[int]
    finish_reason: str


class StubLLM:
    """A stand-in engine for tests (STUB_ENGINE_ENV): one deterministic token per row, from its seed."""

    def generate(self, prompts: list[list[int]], params: list[Any], use_tqdm: bool = False
                 ) -> list[_StubOutput]:
        return [_StubOutput(f"stub-{sp.seed % 1000:03d}", [sp.seed % 1000], "length") for sp in params]


class EngineStage:
    """Ray Data actor stage (and local-executor callable) holding one LLM.

    Rows already carrying an error pass through. Engine ValueErrors are per-row problems (e.g. a schema
    the grammar cannot compile for one row): when a batch raises one, its rows are retried one by one so
    only the offending rows are quarantined (stage 'generate', code GENERATION_ERROR).
    """

    def __init__(self, model_ref: str, engine_kwargs: dict[str, Any], sampling_kwargs: dict[str, Any],
                 job_seed: int, output_schema: dict | None, stub: bool = False) -> None:
        from deepinfer.pipeline.errors import SpecError

        try:
            self.llm = StubLLM() if stub else _load_llm(model_ref, engine_kwargs)
        except ValueError as exc:  # the engine names what to change in the spec's model section
            raise SpecError([f"model: the engine refused its configuration: {exc}"]) from exc
        self.sampling_kwargs, self.job_seed = dict(sampling_kwargs), job_seed
        self.output_schema = output_schema
        self.validator = None
        if output_schema is not None:
            from jsonschema import Draft202012Validator

            self.validator = Draft202012Validator(output_schema)
        self.engine_id = f"{socket.gethostname()}:{os.getpid()}"
        accepts_tqdm = "use_tqdm" in inspect.signature(self.llm.generate).parameters
        self._tqdm_kw = {"use_tqdm": False} if accepts_tqdm else {}
        self.first_token_at: float | None = None
        self._watch_first_step()

    def _watch_first_step(self) -> None:
        """Record when the engine's first step returns: its first prefill has then sampled a first token.

        The engine has no first-token callback, so this wraps its step() on this instance only, once;
        engines without one fall back to the end of the first generate call (see __call__).
        """
        core = getattr(self.llm, "engine", None)
        step = getattr(core, "step", None)
        if step is None:
            return

        def first_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            if self.first_token_at is None:
                self.first_token_at = time.time()
                core.step = step  # unwrap: later steps pay nothing
            return out

        core.step = first_step

    def generate_part(self, table: pa.Table, batch_size: int) -> pa.Table:
        """Generate for a whole part (TOKENIZE_SCHEMA rows, length-sorted per window), `batch_size` rows
        per engine call (runtime.batch_size); returns its ENGINE_SCHEMA rows in one table."""
        if table.num_rows <= batch_size:
            return self(table)
        chunks = [self(table.slice(start, batch_size)) for start in range(0, table.num_rows, batch_size)]
        return pa.concat_tables(chunks)

    def _params(self, row_id: str):
        from deepinfer.engine import SamplingParams
        from deepinfer.engine.sample.rng import derive_seed

        seed = derive_seed(self.job_seed, row_id)
        return SamplingParams(**self.sampling_kwargs, seed=seed, json_schema=self.output_schema), seed

    def _generate(self, prompts: list[list[int]], params: list) -> list[Any]:
        """Outputs per prompt; a ValueError for the batch is narrowed down to the rows that raise it."""
        try:
            return self.llm.generate(prompts, params, **self._tqdm_kw)
        except ValueError:
            if len(prompts) == 1:
                raise
        results: list[Any] = []
        for p, sp in zip(prompts, params):
            try:
                results.extend(self.llm.generate([p], [sp], **self._tqdm_kw))
            except ValueError as exc:
                results.append(exc)
        return results

    def __call__(self, batch: pa.Table) -> pa.Table:
        names = [f.name for f in C.ENGINE_SCHEMA if f.name in batch.schema.names]
        cols = {name: batch.column(name).to_pylist() for name in names}
        n = batch.num_rows
        for name in ("__text", "__finish", "__ntok", "__seed", "__json", "__engine", "__gen_s", "__t_first"):
            cols[name] = [None] * n
        live = [i for i in range(n) if cols["__err_stage"][i] is None]
        ids = batch.column("__ids").to_pylist()
        params, seeds = [], []
        for i in live:
            sp, seed = self._params(cols["__row_id"][i])
            params.append(sp)
            seeds.append(seed)
        start = time.perf_counter()
        outputs = self._generate([ids[i] for i in live], params) if live else []
        share = (time.perf_counter() - start) / max(len(live), 1)
        if live and self.first_token_at is None:
            self.first_token_at = time.time()
        for i, seed, out in zip(live, seeds, outputs):
            cols["__seed"][i], cols["__engine"][i], cols["__gen_s"][i] = seed, self.engine_id, share
            cols["__t_first"][i] = self.first_token_at
            if isinstance(out, ValueError):
                self._fail(cols, i, ("generate", "GENERATION_ERROR", str(out)))
                continue
            cols["__text"][i], cols["__finish"][i] = out.text, out.finish_reason
            cols["__ntok"][i] = len(out.token_ids)
            if self.validator is not None:
                canonical, err = _validate_output(out.text, out.finish_reason, self.validator)
                cols["__json"][i] = canonical
                if err is not None:
                    self._fail(cols, i, err)
        return C.table(cols, C.ENGINE_SCHEMA)

    @staticmethod
    def _fail(cols: dict[str, list], i: int, err: tuple[str, str, str]) -> None:
        cols["__err_stage"][i], cols["__err_code"][i], cols["__err_msg"][i] = err
