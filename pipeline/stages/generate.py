"""The engine stage: one deepinfer.engine.LLM per actor, generating for a batch of tokenized rows.

Each row is sampled with its own seed, derive_seed(job seed, row id), and the engine is batch-invariant,
so a row's output does not depend on the batch it lands in. With an output_schema the text is parsed and
validated with jsonschema; rows that fail (or hit max_tokens) are quarantined, not written as results.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import time
from collections.abc import Callable
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




# Size of a CPU engine's KV cache (GiB) instead of LLM's default 1 GiB: zeroing that takes most of a tiny
# model's engine start, which the test suite pays in every submit it runs (tests/conftest.py sets 0.0625).
CPU_KV_CACHE_ENV = "DEEPINFER_CPU_KV_CACHE_GIB"
GRAPH_CAPTURE_ENV = "DEEPINFER_CUDA_GRAPH_CAPTURE"   # engine/runner/cuda_graphs.capture_mode


def _build_llm(model_ref: str, engine_kwargs: dict[str, Any]) -> Any:
    from deepinfer.engine import LLM

    gib = os.environ.get(CPU_KV_CACHE_ENV)
    if gib is not None:
        try:
            engine_kwargs = {**engine_kwargs, "cpu_kv_cache_gib": float(gib)}
        except ValueError:
            raise ValueError(f"{CPU_KV_CACHE_ENV}={gib!r}: expected a number of GiB, e.g. 0.25") from None
    # A job's parts are uniform batches that decode at a few batch sizes: its engine captures each CUDA
    # graph bucket on first use instead of all of them at start-up (seconds on a large model; the same
    # bits, engine/runner/cuda_graphs.py). A user's own $DEEPINFER_CUDA_GRAPH_CAPTURE wins.
    if GRAPH_CAPTURE_ENV not in os.environ and "cuda_graph_capture" not in engine_kwargs:
        engine_kwargs = {**engine_kwargs, "cuda_graph_capture": "lazy"}
    return LLM(model=model_ref, **engine_kwargs)


class EngineCache:
    """The engines one process has built, by model and engine settings: stages given the same cache share
    one LLM, so a sweep's points build each model once (created by the sweep, passed down explicitly).

    Safe for the output bytes: a row depends only on its own prompt, parameters and seed (batch-invariant
    engine), not on what the engine ran before. `builds` counts the models actually built.
    """

    def __init__(self) -> None:
        self._engines: dict[str, Any] = {}
        self.builds = 0

    def get(self, model_ref: str, engine_kwargs: dict[str, Any]) -> Any:
        """The cached LLM of these settings, built on first use; an engine that refuses its settings
        (ValueError) raises SpecError (exit 2) naming what it refused."""
        from deepinfer.pipeline.errors import SpecError

        key = json.dumps([model_ref, engine_kwargs], sort_keys=True, default=str)
        if key not in self._engines:
            try:
                self._engines[key] = _build_llm(model_ref, engine_kwargs)
            except ValueError as exc:  # the engine names what to change in the spec's model section
                raise SpecError([f"model: the engine refused its configuration: {exc}"]) from exc
            self.builds += 1
        return self._engines[key]


@dataclass(frozen=True)
class _StubOutput:
    text: str
    token_ids: list[int]
    finish_reason: str


STUB_TEXT = "<deepinfer-benchmark-stub seed={seed:016x}>"


class StubLLM:
    """The engine of `runtime.benchmark_stub_engine: true` (pipeline benchmark mode, not inference).

    No model runs: each row gets one placeholder token and the fixed text :data:`STUB_TEXT` of its own
    seed, so the rows are deterministic and tell apart, while reading, tokenizing, part planning, commits
    and resume run for real at stub speed. The setting is in the job's fingerprint (job.schema.json), so
    such an output is never resumed by, or taken for, a real run's output; the text says what it is.
    """

    def generate(self, prompts: list[list[int]], params: list[Any], use_tqdm: bool = False
                 ) -> list[_StubOutput]:
        return [_StubOutput(STUB_TEXT.format(seed=sp.seed), [sp.seed % 1000], "length") for sp in params]


class EngineStage:
    """Ray Data actor stage (and local-executor callable) holding one LLM (from `engines` when given,
    shared with the other stages that use it; else its own). `on_imported` is called once the engine's
    modules are imported, before the model is built (the local executor starts preparing parts then).

    Rows already carrying an error pass through. Engine ValueErrors are per-row problems (e.g. a schema
    the grammar cannot compile for one row): when a batch raises one, its rows are retried one by one so
    only the offending rows are quarantined (stage 'generate', code GENERATION_ERROR).
    """

    def __init__(self, model_ref: str, engine_kwargs: dict[str, Any], sampling_kwargs: dict[str, Any],
                 job_seed: int, output_schema: dict | None, stub: bool = False, schema_mode: str = "strict",
                 batch_input: bool = False, engines: EngineCache | None = None,
                 on_imported: Callable[[], None] | None = None, numerics: str | None = None) -> None:
        from deepinfer.pipeline.stages.engine_rows import RowRequests
        from deepinfer.pipeline.startup_clock import process_started_epoch

        # Start-up marks (epochs) for the run summary's `startup` (startup_clock.StartupClock): this process's
        # start, this constructor, the engine package imported (torch), the model built, ready (mark_ready).
        self.marks: dict[str, float | None] = {"process": process_started_epoch(), "init": time.time()}
        if not stub:
            import deepinfer.engine.llm  # noqa: F401 - torch and the engine's modules, timed apart from the build
        self.marks["imported"] = time.time()
        if on_imported is not None:  # the imports (GIL-bound) are done; the model build is mostly native
            on_imported()
        self.llm = StubLLM() if stub else (engines or EngineCache()).get(model_ref, engine_kwargs)
        # the LLM's own construction phases (allocated, weights_loaded, kv_allocated), when it has them
        self.marks.update(getattr(self.llm, "startup_marks", None) or {})
        self.sampling_kwargs, self.job_seed = dict(sampling_kwargs), job_seed
        self.output_schema = output_schema
        self.validator = None
        if output_schema is not None:
            from jsonschema import Draft202012Validator

            self.validator = Draft202012Validator(output_schema)
        # per-row requests: Batch bodies, n samples, logprobs, choice options, output_schema_mode
        self.requests = RowRequests(sampling_kwargs, job_seed, output_schema, schema_mode, batch_input)
        self.engine_id = f"{socket.gethostname()}:{os.getpid()}"
        # This engine's numerics stack (None: a stub), and the one the output's parts were computed with
        # (`numerics`, a deterministic job's resume): generate_part refuses to run on another.
        self.numerics: str | None = getattr(self.llm, "numerics_stack", None)
        self.expected_numerics = numerics
        accepts_tqdm = "use_tqdm" in inspect.signature(self.llm.generate).parameters
        self._tqdm_kw = {"use_tqdm": False} if accepts_tqdm else {}
        self.first_token_at: float | None = None
        self._watch_first_step()
        self.marks["built"] = time.time()
        self._idle_since = 0.0  # when this engine last finished a part (or became ready)
        self.mark_ready()

    def mark_ready(self) -> None:
        """The engine's owner is set up (a Ray actor's committer opened): parts may come."""
        self.marks["ready"] = self._idle_since = time.time()

    def part_timing(self, started: float, generated: float, finished: float) -> dict[str, Any]:
        """One part's figures for the summary: how long the ready engine waited for it (idle: no part
        prepared yet), generated it, committed it (Ray actors); the start-up marks on the first part."""
        figures: dict[str, Any] = {"engine": self.engine_id, "received": started,
                                   "wait_s": max(started - self._idle_since, 0.0),
                                   "generate_s": generated - started, "commit_s": finished - generated}
        if "sent" not in self.marks:
            self.marks["sent"] = finished
            figures["startup"] = {k: v for k, v in self.marks.items() if k != "sent"}
            stats = self._spec_counters() or {}
            figures["cuda_graph_capture_s"] = stats.get("cuda_graph_capture_s")
        self._idle_since = finished
        return figures

    def _watch_first_step(self) -> None:
        """Record when the engine's first sampled tokens reach the host: the first scheduler.update, which
        both loops call once per step with that step's sampled ids (the synchronous loop in
        EngineCore.step; the overlapped loop, which never calls step(), in core/overlap.py's _apply).

        The engine has no first-token callback, so this wraps its scheduler's update() on this instance
        only, once; engines without one fall back to the end of the first generate call (see __call__).
        """
        scheduler = getattr(getattr(self.llm, "engine", None), "scheduler", None)
        update = getattr(scheduler, "update", None)
        if update is None:
            return

        def first_update(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            if self.first_token_at is None:
                self.first_token_at = time.time()
            scheduler.update = update  # unwrap: later steps pay nothing
            return out

        scheduler.update = first_update

    def generate_part(self, table: pa.Table, batch_size: int,
                      finish: Callable[[pa.Table], pa.Table] | None = None) -> pa.Table:
        """Generate for a whole part (TOKENIZE_SCHEMA rows, length-sorted per window), `batch_size` rows
        per engine call (runtime.batch_size); returns its ENGINE_SCHEMA rows in one table, or what
        `finish` (a Ray actor's commit) makes of them. The part's timing rides on its first row's `__spec`.
        NumericsMismatch before anything is generated when this engine's stack is not the output's."""
        if self.expected_numerics is not None and self.numerics not in (None, self.expected_numerics):
            from deepinfer.pipeline.output.numerics import refusal

            raise refusal(self.expected_numerics, [str(self.numerics)], f"engine {self.engine_id}")
        started = time.time()
        if table.num_rows <= batch_size:
            out = self(table)
        else:
            out = pa.concat_tables([self(table.slice(start, batch_size))
                                    for start in range(0, table.num_rows, batch_size)])
        generated = time.time()
        if finish is not None:
            out = finish(out)
        return with_timing(out, self.part_timing(started, generated, time.time()))

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
        for name in ("__text", "__finish", "__ntok", "__seed", "__json", "__engine", "__gen_s", "__t_first",
                     "__extra", "__spec", "__numerics"):
            cols[name] = [None] * n
        live = [i for i in range(n) if cols["__err_stage"][i] is None]
        ids = batch.column("__ids").to_pylist()
        aux_col = batch.column("__aux").to_pylist() if "__aux" in batch.schema.names else [None] * n
        auxes = {i: C.loads(aux_col[i]) if aux_col[i] else {} for i in live}
        reqs = {i: self.requests.request(cols["__row_id"][i], auxes[i]) for i in live}
        prompts, params = [ids[i] for i in live], [reqs[i].params for i in live]
        spans: dict[int, tuple[int, int]] = {}  # row -> its option requests' slice of the outputs
        for i in live:
            option_ids, option_params = self.requests.choice_requests(auxes[i], reqs[i].seed)
            if option_ids:
                spans[i] = (len(prompts), len(prompts) + len(option_ids))
                prompts += option_ids
                params += option_params
        start = time.perf_counter()
        before = self._spec_counters() if live else None
        outputs = self._generate(prompts, params) if live else []
        if before is not None:
            cols["__spec"][live[0]] = self._spec_delta(before)
        share = (time.perf_counter() - start) / max(len(live), 1)
        if live and self.first_token_at is None:
            self.first_token_at = time.time()
        for i, out in zip(live, outputs):
            cols["__seed"][i], cols["__engine"][i], cols["__gen_s"][i] = reqs[i].seed, self.engine_id, share
            cols["__t_first"][i], cols["__numerics"][i] = self.first_token_at, self.numerics
            if isinstance(out, ValueError):
                self._fail(cols, i, ("generate", "GENERATION_ERROR", str(out)))
                continue
            logliks = self.requests.logliks(auxes[i], outputs[slice(*spans[i])]) if i in spans else None
            res = self.requests.fold(reqs[i], out, auxes[i], logliks)
            cols["__text"][i], cols["__finish"][i], cols["__ntok"][i] = res.text, res.finish, res.ntok
            cols["__json"][i], cols["__extra"][i] = res.json, res.extra
            if res.error is not None:
                self._fail(cols, i, res.error)
        return C.table(cols, C.ENGINE_SCHEMA)

    def _spec_counters(self) -> dict[str, Any] | None:
        """The engine's speculative-decoding counters (LLM.get_stats), None for an engine without any."""
        get_stats = getattr(self.llm, "get_stats", None)
        return get_stats() if get_stats is not None else None

    def _spec_delta(self, before: dict[str, Any]) -> str:
        """One engine call's MTP figures as `__spec` JSON: counter deltas (the driver sums them per engine,
        so they are right whatever order the batches come back in) and the engine's state after the call."""
        after = self._spec_counters() or {}
        keys = (("drafted", "spec_drafted_tokens"), ("accepted", "spec_accepted_tokens"),
                ("verify_steps", "spec_verify_steps"))
        figures: dict[str, Any] = {k: int(after.get(s, 0)) - int(before.get(s, 0)) for k, s in keys}
        figures.update(
            enabled=bool(after.get("spec_enabled", False)), active=bool(after.get("spec_active", False)),
            disabled_reason=after.get("spec_disabled_reason"),
            estimated_speedup=float(after.get("spec_estimated_speedup", 0.0)),
            verify_steps_total=int(after.get("spec_verify_steps", 0)))
        return json.dumps(figures, sort_keys=True)

    @staticmethod
    def _fail(cols: dict[str, list], i: int, err: tuple[str, str, str]) -> None:
        cols["__err_stage"][i], cols["__err_code"][i], cols["__err_msg"][i] = err


def with_timing(table: pa.Table, timing: dict[str, Any]) -> pa.Table:
    """`table` with `timing` added under "timing" to the `__spec` JSON of its first row (merged with the
    MTP figures already there): how per-part engine figures reach the driver (startup_clock.StartupClock)."""
    if table.num_rows == 0 or "__spec" not in table.schema.names:
        return table
    index = table.schema.get_field_index("__spec")
    specs = table.column(index).to_pylist()
    figures = json.loads(specs[0]) if specs[0] is not None else {}
    specs[0] = json.dumps({**figures, "timing": timing}, sort_keys=True)
    return table.set_column(index, table.schema.field(index), pa.array(specs, type=pa.string()))
