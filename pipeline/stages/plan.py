"""Everything the stages need, in one picklable value, plus factories for each stage.

Both executors build their stages from a `StagePlan`, so Ray and in-process runs execute the same code
with the same settings. Workers resolve the model themselves (`model_ref`, e.g. 'demo' builds the demo
checkpoint once per machine), so nothing machine-local travels from the driver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.spec.load import JobSpec
from deepinfer.pipeline.stages.generate import EngineStage
from deepinfer.pipeline.stages.prompt import PromptStage, ReadStage, TokenizeStage, model_max_len


def resolve_model_dir(model_ref: str) -> str:
    """The local directory of a model reference (path, 'demo', $DEEPINFER_HF_MODEL_DIR name, HF cache id)."""
    from deepinfer.engine.models.loader import resolve_model_dir as _resolve

    return str(_resolve(model_ref))


@dataclass(frozen=True)
class StagePlan:
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
        )

    def read_stage(self) -> ReadStage:
        return ReadStage(self.input_format, self.input_storage_options)

    def prompt_stage(self) -> PromptStage:
        return PromptStage(self.template, self.system, self.id_column, self.keep_columns,
                           self.output_id_column)

    def tokenize_stage(self) -> TokenizeStage:
        model_dir = resolve_model_dir(self.model_ref)
        limit = model_max_len(model_dir, self.max_model_len)
        return TokenizeStage(model_dir, self.mode, limit, self.chat_date)

    def engine_stage(self) -> EngineStage:
        return EngineStage(self.model_ref, self.engine_kwargs, self.sampling_kwargs, self.job_seed,
                           self.output_schema)


def part_items(parts: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Part descriptors as Ray Data items (one JSON string column, so every block has the same schema)."""
    return [{"part": json.dumps(p, sort_keys=True)} for p in parts]


def parts_table(parts: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(part_items(parts), schema=pa.schema([("part", pa.string())]))


# Callable-class adapters for Ray Data: the constructor receives the plan, __call__ a pyarrow batch.
class TokenizeActor:
    def __init__(self, plan: StagePlan) -> None:
        self.stage = plan.tokenize_stage()

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)


class EngineActor:
    def __init__(self, plan: StagePlan) -> None:
        self.stage = plan.engine_stage()

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)


def read_batch(batch: pa.Table, plan: StagePlan) -> pa.Table:
    """Ray Data task stage: part descriptors -> the parts' rows."""
    return plan.read_stage()(batch)


def prompt_batch(batch: pa.Table, plan: StagePlan) -> pa.Table:
    """Ray Data task stage: rows -> rendered prompts (templates compile in microseconds: no actor needed)."""
    return plan.prompt_stage()(batch)
