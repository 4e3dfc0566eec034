"""`output_schema_mode: validate`: the part of an output_schema that constrained decoding can enforce.

The subsetting itself is the engine's (engine/structured/enforceable.py, also behind
`SamplingParams(json_schema_mode="validate")`); here it runs with the pipeline's torch-free probe
(spec/output_columns.grammar_problems), so `validate` checks a spec without a model and reports problems
in the spec's terms. In validate mode the job constrains generation by the returned schema, then validates
every answer against the whole schema with jsonschema (stages/engine_rows.py) and quarantines what fails
(SCHEMA_VIOLATION).
"""

from __future__ import annotations

from typing import Any


def enforceable_part(schema: dict) -> tuple[Any, list[str], list[str]]:
    """(schema for the grammar, keywords dropped or relaxed, problems left). `problems` is empty when the
    returned schema compiles; a schema that is not a valid JSON Schema comes back with its problem."""
    from deepinfer.engine.structured.enforceable import enforceable_part as engine_enforceable_part
    from deepinfer.pipeline.spec.output_columns import grammar_problems

    return engine_enforceable_part(schema, grammar_problems)
