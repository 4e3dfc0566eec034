"""Turns a request's sampled tokens into its text and builds its `RequestOutput`."""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, decode_output
from deepinfer.engine.text.tokenizer import Tokenizer


class OutputProcessor:
    """Per-request detokenization: the incremental detokenizer of requests with stop strings (the finish
    rules in core/finish.py feed it and read its stop-string match) and the final `RequestOutput`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # token id -> its text alone (Logprob.decoded_token); at most one entry per vocabulary id.
        self._decoded: dict[int, str] = {}

    def add(self, seq: Sequence) -> None:
        """Give `seq` its incremental detokenizer when it has stop strings."""
        p = seq.params
        if p.stop:
            # Only stop strings need text while generating; other requests are decoded once at the end.
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
            )

    def build_output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        """The finished sequence's output: one completion (index = its sample index; LLM.generate merges
        the n samples of a request), its text truncated at a matched stop string."""
        detok, seq.detokenizer = seq.detokenizer, None
        if detok is not None:
            detok.finish()
            text = detok.text
        else:
            text = decode_output(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids,
                                 seq.params.skip_special_tokens)
        logprobs = None
        cumulative = None
        if seq.logprobs is not None:
            logprobs = [self._position(d) for d in seq.logprobs]
            cumulative = sum(next(iter(d.values())) for d in seq.logprobs)
        completion = CompletionOutput(
            index=seq.sample_index, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason or "length", logprobs=logprobs, seed=seq.seed,
            cumulative_logprob=cumulative,
        )
        if seq.params.json_schema_mode == "validate":
            from deepinfer.engine.structured.enforceable import validate_completion

            verdict = validate_completion(text, seq.params.json_schema)
            completion.schema_valid, completion.schema_error = verdict
        prompt_logprobs = None
        if seq.prompt_logprobs is not None:
            prompt_logprobs = [None if d is None else self._position(d) for d in seq.prompt_logprobs]
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            prompt_logprobs=prompt_logprobs,
            metrics={"num_cached_tokens": seq.num_cached_tokens, "num_preemptions": seq.num_preemptions},
        )

    def _position(self, entry: Mapping[int, float]) -> PositionLogprobs:
        """Logprob objects of one position. The first key is the sampled (or prompt) token, whose rank the
        sampler computed; the others are the top-k in rank order, so they take ranks 1..k, skipping the first
        token's rank when it is among them (the sampler's SampledLogprobs documents the layout)."""
        items = list(entry.items())
        first_rank = getattr(entry, "rank", None)
        out: PositionLogprobs = {}
        rank = 0
        for j, (tid, lp) in enumerate(items):
            if j == 0:
                r = first_rank
            else:
                rank += 1
                if rank == first_rank:
                    rank += 1
                r = rank
            out[tid] = Logprob(logprob=lp, rank=r, decoded_token=self._decode(tid))
        return out

    def _decode(self, token_id: int) -> str:
        # Special tokens keep their text ("</s>"), as vLLM shows them: a logprob entry names the token.
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
