"""Job specs: YAML -> validated, defaults-filled, frozen `JobSpec`.

`load_spec(path, overrides)` is what the CLI calls. Order of operations:
1. the file (at most MAX_SPEC_BYTES, UTF-8) is parsed by safe_yaml.load_spec_text, which bounds depth,
   alias expansion and size and refuses tags, non-string keys, NaN/inf and duplicate keys;
2. relative local paths in it (model.path, input.path, output.path) are made absolute against the spec
   file's directory, so a spec works from any working directory;
3. `--set a.b=value` overrides are applied (value parsed by safe_yaml.parse_override, intermediate mappings
   created); paths given this way are relative to the current directory, like any command-line path;
4. the document is validated against schemas/job.schema.json (bounds first, then defaults filled in), then
   the checks the schema cannot express (output_schema is itself a valid JSON Schema, the templates
   compile in the sandbox with known filters and tests, column clashes, storage options are an allow-list
   of non-secret settings, output.path is not a root and does not overlap the input).
Every problem raises SpecError naming the field. Nothing here imports torch or ray.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.pipeline.spec.bounds import more_nodes_than
from deepinfer.pipeline.spec.engine_options import EngineOptions
from deepinfer.pipeline.spec.paths import output_path_problems, scheme_problems
from deepinfer.pipeline.spec.request_formats import request_format_problems
from deepinfer.pipeline.spec.safe_yaml import SpecSyntaxError, load_spec_text, parse_override, short
from deepinfer.pipeline.spec.schema import SpecError, validate_document
from deepinfer.pipeline.spec.secrets import looks_secret, redact, storage_option_problems, url_problems

PATH_FIELDS = (("model", "path"), ("input", "path"), ("output", "path"))
# Output columns the pipeline writes itself; output_schema properties and kept columns may not reuse them.
RESERVED_COLUMNS = ("text", "finish_reason", "prompt_tokens", "output_tokens", "seed", "json", "sample_index",
                    "logprobs", "prompt_logprobs")
DEFAULT_ID_COLUMN = "id"

# Kept importable from here: the secret rule lives in secrets.py.
__all__ = ["JobSpec", "SpecError", "apply_override", "load_document", "load_spec", "looks_secret", "redact"]
MAX_SPEC_BYTES = 1_000_000
# Real specs hold well under a thousand values; 20,000 leaves room for large output_schemas while
# keeping the worst case (parse, bounds walk, schema validation) far below validate's 2 s budget.
MAX_SPEC_NODES = 20_000
MAX_KEY_PARTS = 16
MAX_OUTPUT_SCHEMA_NODES = 5000


def is_remote(path: str) -> bool:
    """True for URLs with a scheme (s3://, gs://, memory://...), False for local paths."""
    return "://" in path


def _absolute(path: str, base: Path) -> str:
    if is_remote(path):
        return path
    expanded = os.path.expanduser(path)
    return str(Path(expanded) if os.path.isabs(expanded) else (base / expanded).resolve())


def _resolve_paths(doc: dict, base: Path, only: set[tuple[str, str]] | None = None) -> None:
    for section, key in PATH_FIELDS:
        if only is not None and (section, key) not in only:
            continue
        sub = doc.get(section)
        if isinstance(sub, dict) and isinstance(sub.get(key), str) and sub[key]:
            sub[key] = _absolute(sub[key], base)


def apply_override(doc: dict, assignment: str) -> tuple[str, ...]:
    """Apply one `a.b.c=value` override in place (value parsed as YAML); returns the key path."""
    if "=" not in assignment:
        raise SpecError([f"--set {short(assignment)}: expected KEY=VALUE, e.g. --set input.path=data/"])
    key, _, raw = assignment.partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not key.strip() or any(not p for p in parts) or len(parts) > MAX_KEY_PARTS or len(key) > 500:
        raise SpecError([f"--set {short(assignment)}: the key must be a dotted field path like output.path"])
    try:
        value = parse_override(raw, key.strip())
    except SpecSyntaxError as exc:
        raise SpecError([str(exc)]) from None
    node: Any = doc
    for i, name in enumerate(parts[:-1]):
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise SpecError([f"--set {key}: {where} is a {type(child).__name__}, not a mapping"])
        node = child
    node[parts[-1]] = value
    return parts


@dataclass(frozen=True)
class ModelSpec(EngineOptions):
    """model: which checkpoint and the engine's construction arguments."""

    name: str | None
    path: str | None
    dtype: str
    device: str
    max_model_len: int | None
    deterministic: bool
    enable_prefix_caching: bool
    allow_pickle: bool

    @property
    def ref(self) -> str:
        """What to hand `LLM(model=...)`: the local path, else the name."""
        return self.path if self.path is not None else str(self.name)


@dataclass(frozen=True)
class InputSpec:
    path: str
    format: str
    id_column: str | None
    storage_options: dict = field(default_factory=dict)
    on_bad_file: str = "fail"


@dataclass(frozen=True)
class PromptSpec:
    template: str | None
    mode: str
    system: str | None
    chat_date: str
    messages_column: str | None = None


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    seed: int
    stop: tuple[str, ...] | None
    stop_token_ids: tuple[int, ...] | None
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def params_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments shared by every row (the row seed is added per row)."""
        return {
            "temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": self.top_k,
            "min_p": float(self.min_p), "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
            "stop": list(self.stop) if self.stop else None,
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "ignore_eos": self.ignore_eos, "repetition_penalty": float(self.repetition_penalty),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            # only when asked for: the engine's defaults (n=1, no logprobs) are what older jobs ran with
            **({"n": self.n} if self.n != 1 else {}),
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
            **({"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}),
        }


@dataclass(frozen=True)
class OutputSpec:
    path: str
    format: str
    keep_columns: tuple[str, ...]
    storage_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeSpec:
    executor: str
    engines: int | None
    batch_size: int
    sort_window: int
    rows_per_part: int
    max_error_fraction: float
    engine_cpus: float
    max_batches_in_flight: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    shared_filesystem: bool = False  # local paths are visible to every node (multi-node clusters)
    benchmark_stub_engine: bool = False  # pipeline benchmark mode: no model runs (fingerprinted)


@dataclass(frozen=True)
class JobSpec:
    """A validated job. `document` is the resolved spec (absolute paths, defaults filled): what _job.json
    records and what `deepinfer-job status SPEC` re-reads."""

    name: str | None
    model: ModelSpec
    input: InputSpec
    prompt: PromptSpec
    sampling: SamplingSpec
    output_schema: dict | None
    output: OutputSpec
    runtime: RuntimeSpec
    document: dict
    eval: Any = None  # evaluation.EvalSpec when the spec has an `eval:` section
    sweep: dict | None = None  # the `sweep:` section; sweep.expand_points turns it into point specs
    output_schema_mode: str = "strict"  # 'validate': grammar from the enforceable part, jsonschema after

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for deepinfer.engine.LLM besides `model` (nulls left to the engine)."""
        m, r = self.model, self.runtime
        kwargs = {
            "dtype": m.dtype, "device": m.device, "deterministic": m.deterministic, **m.engine_options(),
            "enable_prefix_caching": m.enable_prefix_caching, "allow_pickle": m.allow_pickle,
            "max_num_seqs": r.max_num_seqs, "gpu_memory_utilization": r.gpu_memory_utilization,
        }
        if m.max_model_len is not None:
            kwargs["max_model_len"] = m.max_model_len
        if r.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = r.max_num_batched_tokens
        return kwargs

    @property
    def id_column(self) -> str:
        """The output's id column: input.id_column when given, else 'id'."""
        return self.input.id_column or DEFAULT_ID_COLUMN

    @classmethod
    def from_document(cls, doc: Any) -> JobSpec:
        """Validate a spec document (paths already resolved) and build the JobSpec."""
        from deepinfer.pipeline.evaluation import EvalSpec

        filled = validate_document(doc)
        if filled["input"]["format"] == "openai_batch" and filled["input"]["id_column"] is None:
            filled["input"]["id_column"] = "custom_id"  # the Batch API's request id is the row id
        _semantic_checks(filled)
        s, o, r = filled["sampling"], filled["output"], filled["runtime"]
        evaluation = EvalSpec.from_document(filled["eval"]) if filled.get("eval") else None
        keep = tuple(o["keep_columns"])
        if evaluation is not None:  # scores sit next to their reference (and group) in every part
            id_column = filled["input"]["id_column"] or DEFAULT_ID_COLUMN
            keep += tuple(c for c in evaluation.input_columns if c not in keep and c != id_column)
        return cls(
            name=filled["name"],
            model=ModelSpec(**filled["model"]),
            input=InputSpec(**filled["input"]),
            prompt=PromptSpec(**filled["prompt"]),
            sampling=SamplingSpec(**{**s, "stop": tuple(s["stop"]) if s["stop"] else None,
                                     "stop_token_ids": tuple(s["stop_token_ids"]) if s["stop_token_ids"]
                                     else None}),
            output_schema=filled["output_schema"],
            output=OutputSpec(**{**o, "keep_columns": keep}),
            runtime=RuntimeSpec(**r),
            document=filled,
            eval=evaluation,
            sweep=filled.get("sweep"),
            output_schema_mode=filled["output_schema_mode"],
        )


def _semantic_checks(doc: dict) -> None:
    """What JSON Schema cannot say: one model source, a valid output_schema, template syntax, clashes."""
    problems: list[str] = []
    model = doc["model"]
    if (model["name"] is None) == (model["path"] is None):
        problems.append("model: give exactly one of model.name (e.g. 'demo') or model.path "
                        "(a local directory)")
    top_k = doc["sampling"]["top_k"]
    if top_k == 0:
        problems.append("sampling.top_k: 0 is not allowed (expected: -1 to disable, or an integer >= 1)")
    if doc["prompt"]["mode"] == "raw" and doc["prompt"]["system"] is not None:
        problems.append("prompt.system: only used in chat mode; remove it or set prompt.mode: chat")
    problems += _template_problems(doc["prompt"])
    problems += request_format_problems(doc)  # prompt source (template, messages, Batch) + formats
    for section in ("input", "output"):
        problems += storage_option_problems(doc[section]["storage_options"], f"{section}.storage_options")
        problems += url_problems(doc[section]["path"], f"{section}.path")
        problems += scheme_problems(doc[section]["path"], f"{section}.path")
    problems += url_problems(model["path"], "model.path") + url_problems(model["name"], "model.name")
    try:
        _dt.date.fromisoformat(doc["prompt"]["chat_date"])
    except ValueError:
        problems.append(f"prompt.chat_date: {short(doc['prompt']['chat_date'])} is not a real date "
                        "(YYYY-MM-DD)")
    id_column = doc["input"]["id_column"] or DEFAULT_ID_COLUMN
    taken = {*RESERVED_COLUMNS, id_column}
    for col in doc["output"]["keep_columns"]:
        if col in RESERVED_COLUMNS:
            problems.append(f"output.keep_columns: {short(col)} clashes with an output column the pipeline "
                            f"writes ({', '.join(RESERVED_COLUMNS)})")
    schema = doc["output_schema"]
    if schema is not None and more_nodes_than(schema, MAX_OUTPUT_SCHEMA_NODES):
        # Compiling a grammar is super-linear in the schema; real constraint schemas are far smaller.
        problems.append(f"output_schema: more than {MAX_OUTPUT_SCHEMA_NODES:,} values; constraint schemas "
                        "are limited to that size")
    elif schema is not None:
        from deepinfer.pipeline.spec.output_columns import schema_problems

        problems += schema_problems(schema, taken | set(doc["output"]["keep_columns"]),
                                    enforce_all=doc["output_schema_mode"] == "strict")
    problems += output_path_problems(doc["output"]["path"], doc["input"]["path"])
    problems += _eval_and_sweep_problems(doc, taken | set(doc["output"]["keep_columns"]))
    if problems:
        raise SpecError(problems)


def _eval_and_sweep_problems(doc: dict, taken: set[str]) -> list[str]:
    from deepinfer.pipeline.evaluation import EvalSpec, eval_problems
    from deepinfer.pipeline.sweep import sweep_problems

    problems = eval_problems(doc.get("eval"))
    if doc.get("eval") and not problems:
        taken = taken | set((doc["output_schema"] or {}).get("properties") or {})
        for col in EvalSpec.from_document(doc["eval"]).score_columns:
            if col in taken:
                problems.append(f"eval.metrics: the score column {col!r} clashes with an output column")
    return problems + sweep_problems(doc.get("sweep"))


def _template_problems(prompt: dict) -> list[str]:
    """Compile each template in the sandbox the prompt stage uses, so that an unknown filter or test
    (TemplateAssertionError), a syntax error, or a template nested too deep to compile is reported by
    validate, not by every row of a submitted job."""
    from jinja2 import TemplateAssertionError, TemplateError, TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    problems = []
    for key in ("template", "system"):
        source = prompt.get(key)
        if source is None:
            continue
        try:
            env.from_string(source)
            problems += _unknown_names(env, env.parse(source), f"prompt.{key}")
        except TemplateAssertionError as exc:  # an unknown filter or test: compiles only once fixed
            problems.append(f"prompt.{key}: line {exc.lineno}: {short(exc.message or str(exc), 200)}")
        except TemplateSyntaxError as exc:
            problems.append(f"prompt.{key}: template syntax error on line {exc.lineno}: "
                            f"{short(exc.message, 200)}")
        except TemplateError as exc:
            problems.append(f"prompt.{key}: template does not compile: {short(str(exc), 200)}")
        except (RecursionError, MemoryError):
            problems.append(f"prompt.{key}: the template is nested too deeply to compile")
    return problems


def _unknown_names(env: Any, tree: Any, where: str) -> list[str]:
    """Filters and tests the sandbox does not have. Jinja defers these to render time when they sit in a
    conditional branch ({% if x is nosuchtest %}), which would fail every row; the parsed tree names them."""
    from jinja2 import nodes

    problems = []
    for node in tree.find_all((nodes.Filter, nodes.Test)):
        known, kind = (env.filters, "filter") if isinstance(node, nodes.Filter) else (env.tests, "test")
        if node.name not in known:
            problems.append(f"{where}: line {node.lineno}: no {kind} named {short(node.name, 40)}")
    return sorted(set(problems))


def load_document(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Read a YAML spec, resolve its relative paths, apply `--set` overrides (not yet validated)."""
    spec_path = Path(path)
    try:
        size = spec_path.stat().st_size
        if size > MAX_SPEC_BYTES:  # refused before reading: a 60 MB spec costs nothing
            raise SpecError([f"{short(str(path))} is {size:,} bytes; specs are limited to "
                             f"{MAX_SPEC_BYTES:,} bytes"])
        with open(spec_path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError([f"{path}: no such spec file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory, not a spec file"]) from None
    except OSError as exc:
        raise SpecError([f"{path}: cannot read the spec file ({exc.strerror or exc})"]) from None
    try:
        doc = load_spec_text(data, str(path), max_bytes=MAX_SPEC_BYTES, max_nodes=MAX_SPEC_NODES)
    except SpecSyntaxError as exc:
        raise SpecError([str(exc)]) from None
    assert isinstance(doc, dict)  # load_spec_text returns a fresh mapping (or raises)
    _resolve_paths(doc, spec_path.resolve().parent)
    for assignment in overrides:
        keys = apply_override(doc, assignment)
        if len(keys) == 2 and keys in PATH_FIELDS:
            _resolve_paths(doc, Path.cwd(), only={keys})
    return doc


def load_spec(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Load, override and validate a job spec file; raises SpecError naming every bad field."""
    return JobSpec.from_document(load_document(path, overrides))
