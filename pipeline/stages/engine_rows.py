"""The engine requests of a row, and its outputs folded back into ENGINE_SCHEMA values (generate.py).

A row's request: the spec's sampling settings, overridden by a Batch body's parameters (__aux "params";
body.seed replaces the row seed), constrained by output_schema or the row's response_format schema (in
output_schema_mode 'validate' by the enforceable part only: the engine's json_schema_mode), plus one
request per choice_loglikelihood option (stages/choices.py). Its outputs: sample 0 in the fixed columns,
and in __extra (JSON) every sample with its seed and logprobs, the prompt logprobs and the options'
log-likelihoods. Every sample is validated against the whole schema: a row any of whose samples fails is
quarantined as a whole (INVALID_JSON, TRUNCATED, SCHEMA_MISMATCH; SCHEMA_VIOLATION in validate mode).

Logprob layout (one entry per position, JSON here, Arrow in the parts, assemble.py): {token_id, token,
logprob, rank, top: [{token_id, token, logprob, rank}, ...]} with `top` the k most likely tokens by rank
(rank 1 = argmax), the position's own token first in the entry whatever its rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

_TOP = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float64()),
                  ("rank", pa.int64())])
LOGPROB_ENTRY = pa.struct([*_TOP, ("top", pa.list_(_TOP))])
LOGPROBS_TYPE = pa.list_(LOGPROB_ENTRY)  # the parts' logprobs / prompt_logprobs column (null entries allowed)


def position_entries(positions: list | None, k: int | None) -> list[dict | None] | None:
    """Engine logprobs (per position a dict token id -> Logprob, the position's token first) as entries."""
    if positions is None:
        return None
    out: list[dict | None] = []
    for pos in positions:
        if pos is None:
            out.append(None)
            continue
        items = list(pos.items())
        tid, lp = items[0]
        top = sorted(((t, p) for t, p in items if p.rank is not None and p.rank <= (k or 0)),
                     key=lambda e: e[1].rank)
        out.append({"token_id": int(tid), "token": lp.decoded_token, "logprob": float(lp.logprob),
                    "rank": lp.rank, "top": [{"token_id": int(t), "token": p.decoded_token,
                                              "logprob": float(p.logprob), "rank": p.rank} for t, p in top]})
    return out


def _sample_seed(sample: Any, row_seed: int, index: int) -> int:
    seed = getattr(sample, "seed", None)
    if seed is None:
        from deepinfer.engine.sample.rng import sample_seed

        seed = sample_seed(row_seed, index)
    return int(seed)


@dataclass(frozen=True)
class RowRequest:
    params: Any            # SamplingParams of the row's main request
    seed: int
    validator: Any         # jsonschema validator of the whole schema, or None
    violation_code: str    # code of an answer that parses but breaks the schema


@dataclass
class RowResult:
    text: str | None = None
    finish: str | None = None
    ntok: int | None = None
    json: str | None = None
    extra: str | None = None
    error: tuple[str, str, str] | None = None


class RowRequests:
    """Builds the requests of a batch's rows and folds their outputs back (one per EngineStage)."""

    def __init__(self, sampling_kwargs: dict[str, Any], job_seed: int, output_schema: dict | None,
                 schema_mode: str = "strict", batch_input: bool = False) -> None:
        self.base, self.job_seed, self.output_schema = dict(sampling_kwargs), job_seed, output_schema
        self.mode, self.batch_input = schema_mode, batch_input
        self._schemas: dict[str, tuple[Any, Any]] = {}  # canonical schema JSON -> (grammar schema, validator)

    def _schema(self, schema: dict | None) -> tuple[Any, Any]:
        if schema is None:
            return None, None
        key = json.dumps(schema, sort_keys=True)
        if key not in self._schemas:
            from jsonschema import Draft202012Validator

            # validate mode: the engine's json_schema_mode='validate' builds the grammar from the schema's
            # enforceable part (engine/structured/enforceable.py); the rows are checked here in full.
            self._schemas[key] = (schema, Draft202012Validator(schema))
        return self._schemas[key]

    def request(self, row_id: str, aux: dict) -> RowRequest:
        from deepinfer.engine import SamplingParams
        from deepinfer.engine.sample.rng import derive_seed

        overrides = dict(aux.get("params") or {})
        seed = overrides.pop("seed", None)
        seed = derive_seed(self.job_seed, row_id) if seed is None else int(seed)
        grammar, validator = self._schema(aux.get("schema") if self.batch_input else self.output_schema)
        sp = SamplingParams(**{**self.base, **overrides}, seed=seed, json_schema=grammar,
                            json_schema_mode=self.mode if grammar is not None else "strict")
        code = "SCHEMA_VIOLATION" if self.mode == "validate" else "SCHEMA_MISMATCH"
        return RowRequest(sp, seed, validator, code)

    @staticmethod
    def choice_requests(aux: dict, seed: int) -> tuple[list[list[int]], list[Any]]:
        """One greedy 1-token request per option, asking for the prompt logprobs of its tokens."""
        from deepinfer.engine import SamplingParams

        ids = aux.get("choice_ids") or []
        return ids, [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, seed=seed)] * len(ids)

    @staticmethod
    def logliks(aux: dict, outs: list[Any]) -> list[float] | str:
        from deepinfer.pipeline.stages.choices import option_loglikelihood

        for out in outs:
            if isinstance(out, ValueError):
                return f"an option's request failed: {out}"
        if any(getattr(o, "prompt_logprobs", None) is None for o in outs):
            return "the engine returned no prompt logprobs for an option"
        return [option_loglikelihood(o.prompt_logprobs, ids, start)
                for o, ids, start in zip(outs, aux["choice_ids"], aux["choice_ctx"])]

    def fold(self, req: RowRequest, out: Any, aux: dict, logliks: list[float] | str | None) -> RowResult:
        """ENGINE_SCHEMA values of a row from its main output (and its options' log-likelihoods)."""
        from deepinfer.pipeline.stages.generate import _validate_output

        res = RowResult()
        if isinstance(logliks, str):
            res.error = ("generate", "GENERATION_ERROR", f"choice_loglikelihood: {logliks}")
            return res
        samples = list(getattr(out, "outputs", None) or [out])
        sp = req.params
        k = getattr(sp, "logprobs", None)
        entries = []
        for i, s in enumerate(samples):
            canonical = None
            if req.validator is not None:
                canonical, err = _validate_output(s.text, s.finish_reason, req.validator)
                if err is not None:
                    stage, code, msg = err
                    code = req.violation_code if code == "SCHEMA_MISMATCH" else code
                    res.error = (stage, code, msg if len(samples) == 1 else f"sample {i}: {msg}")
                    return res
            entries.append({"text": s.text, "finish": s.finish_reason, "ntok": len(s.token_ids),
                            "seed": _sample_seed(s, req.seed, i), "json": canonical,
                            "logprobs": position_entries(getattr(s, "logprobs", None), k) if k is not None
                            else None})
        first = entries[0]
        # __ntok counts every sample's tokens (the run summary's output tokens); the parts take each
        # sample's own count from "samples"
        res.text, res.finish, res.ntok = first["text"], first["finish"], sum(e["ntok"] for e in entries)
        res.json = first["json"]
        extra: dict[str, Any] = {}
        if len(samples) > 1 or k is not None or self.batch_input:
            extra["samples"] = entries
        if getattr(sp, "prompt_logprobs", None) is not None:
            extra["prompt_logprobs"] = position_entries(getattr(out, "prompt_logprobs", None),
                                                        sp.prompt_logprobs)
        if logliks is not None:
            extra["loglik"] = logliks
        if self.batch_input:
            extra["model"] = aux.get("model")
        res.extra = json.dumps(extra, ensure_ascii=False, separators=(",", ":")) if extra else None
        return res
