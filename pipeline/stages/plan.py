"""Everything the stages need, in one picklable value, plus factories for each stage.

Both executors build their stages from a `StagePlan` and run the same two steps per part —
`prepare_part` (read, prompt, tokenize) and `EngineActor`/`EngineStage.generate_part` — so Ray and
in-process runs execute the same code with the same settings. Workers resolve the model themselves
(`model_ref`, e.g. 'demo' builds the demo checkpoint once per machine), so nothing machine-local travels
from the driver.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
from deepinfer.pipeline.parts import PartTask, tasks_from_table
from deepinfer.pipeline.spec.load import JobSpec
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.generate import EngineCache, EngineStage
from deepinfer.pipeline.stages.packed_parts import pack_parts, unpack_parts
from deepinfer.pipeline.stages.prompt import (
    PromptStage,
    TokenizeStage,
    model_max_len,
    read_part_table,
)
from deepinfer.pipeline.worker_errors import in_worker


def resolve_model_dir(model_ref: str) -> str:
    """The local directory of a model reference (path, 'demo', $DEEPINFER_HF_MODEL_DIR name, HF cache id)."""
    from deepinfer.engine.models.loader import resolve_model_dir as _resolve

    return str(_resolve(model_ref))


@dataclass(frozen=True)
class StagePlan:
    """The spec's settings the worker stages need (picklable; travels to every Ray worker)."""

    input_format: str
    input_storage_options: dict
    template: str
    system: str | None
    mode: str
    chat_date: str
    id_column: str | None
    output_id_column: str
    keep_columns: tuple[str, ...]
    model_ref: str
    engine_kwargs: dict
    max_model_len: int | None
    sampling_kwargs: dict
    job_seed: int
    output_schema: dict | None
    batch_size: int
    sort_window: int
    extra: dict = field(default_factory=dict)
    # The numerics stack the output's committed parts were computed with, in a deterministic job being
    # resumed (output/numerics.py): its engines refuse to generate on another. Not from the spec: the
    # driver sets it from the output (runner.py).
    numerics: str | None = None

    @classmethod
    def from_spec(cls, spec: JobSpec) -> StagePlan:
        return cls(
            input_format=spec.input.format, input_storage_options=dict(spec.input.storage_options),
            template=spec.prompt.template, system=spec.prompt.system, mode=spec.prompt.mode,
            chat_date=spec.prompt.chat_date, id_column=spec.input.id_column,
            output_id_column=spec.id_column, keep_columns=spec.output.keep_columns,
            model_ref=spec.model.ref, engine_kwargs=spec.engine_kwargs(),
            max_model_len=spec.model.max_model_len, sampling_kwargs=spec.sampling.params_kwargs(),
            job_seed=spec.sampling.seed, output_schema=spec.output_schema,
            batch_size=spec.runtime.batch_size, sort_window=spec.runtime.sort_window,
            extra={"on_bad_file": spec.input.on_bad_file,
                   "stub_engine": spec.runtime.benchmark_stub_engine,
                   "messages_column": spec.prompt.messages_column,
                   "choices_column": spec.eval.choices_column if spec.eval is not None else None,
                   "batch_input": spec.input.format == "openai_batch",
                   "schema_mode": spec.output_schema_mode},
        )

    def prompt_stage(self) -> PromptStage:
        return PromptStage(self.template, self.system, self.id_column, self.keep_columns,
                           self.output_id_column, self.extra.get("messages_column"),
                           self.extra.get("choices_column"), bool(self.extra.get("batch_input")))

    def tokenize_stage(self) -> TokenizeStage:
        return _tokenize_stage(self.model_ref, self.max_model_len, self.mode, self.chat_date)

    def engine_stage(self, engines: EngineCache | None = None,
                     on_imported: Callable[[], None] | None = None) -> EngineStage:
        """This plan's engine stage; its LLM comes from `engines` (shared) when given; `on_imported`:
        EngineStage's."""
        # runtime.benchmark_stub_engine (fingerprinted): the spec decides, never a worker's environment.
        return EngineStage(self.model_ref, self.engine_kwargs, self.sampling_kwargs, self.job_seed,
                           self.output_schema, stub=bool(self.extra.get("stub_engine")),
                           schema_mode=self.extra.get("schema_mode", "strict"),
                           batch_input=bool(self.extra.get("batch_input")), engines=engines,
                           on_imported=on_imported, numerics=self.numerics)

    def engine_key(self) -> str:
        """What decides the engine this plan's stage runs on: stages of plans with one key can share it."""
        import json

        return json.dumps([self.model_ref, self.engine_kwargs, bool(self.extra.get("stub_engine"))],
                          sort_keys=True, default=str)


@functools.lru_cache(maxsize=4)
def _tokenize_stage(model_ref: str, max_model_len: int | None, mode: str, chat_date: str) -> TokenizeStage:
    # One tokenizer per worker process, kept across Ray tasks (Ray reuses worker processes), so the CPU
    # stages can be plain tasks that fuse into one per part instead of an actor pool of their own.
    model_dir = resolve_model_dir(model_ref)
    return TokenizeStage(model_dir, mode, model_max_len(model_dir, max_model_len), chat_date)


def prepare_part(plan: StagePlan, task: PartTask) -> pa.Table:
    """Read, prompt and tokenize one part: its TOKENIZE_SCHEMA rows, length-sorted per sort window.

    Windows never cross a part: a part's rows then reach the engine together and the part can be
    committed as soon as they are back (a window spanning parts would hold all of them back).
    """
    rows = plan.prompt_stage()(read_part_table(task.as_mapping(), plan.input_format,
                                               plan.input_storage_options,
                                               plan.extra.get("on_bad_file", "fail")))
    tokenize = plan.tokenize_stage()
    windows = [tokenize(rows.slice(start, plan.sort_window))
               for start in range(0, rows.num_rows, plan.sort_window)]
    return pa.concat_tables(windows) if windows else C.TOKENIZE_SCHEMA.empty_table()


@in_worker
def prepare_batch(batch: pa.Table, plan: StagePlan) -> pa.Table:
    """Ray Data task stage: PART_TASK_SCHEMA rows (one per part) -> one packed row per part, holding its
    tokenized rows (stages/packed_parts.py: what keeps a part whole on its way to an engine)."""
    return pack_parts(prepare_part(plan, task) for task in tasks_from_table(batch))


class EngineActor:
    """Ray Data actor stage: one engine; each call receives whole parts (packed rows, as prepare_batch
    writes them) and returns their results."""

    @in_worker
    def __init__(self, plan: StagePlan) -> None:
        self.stage = plan.engine_stage()
        self.batch_size = plan.batch_size

    @in_worker
    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage.generate_part(unpack_parts(batch, C.TOKENIZE_SCHEMA), self.batch_size)
