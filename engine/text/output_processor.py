"""Turns sampled tokens into text and finishes requests on stop strings and completed grammars."""

from __future__ import annotations

from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, decode_output


class OutputProcessor:
    """Per-request incremental detokenization and text-level stop conditions.

    The scheduler finishes requests on token-level conditions (EOS, stop token ids, max_tokens);
    this class finishes them on stop strings and on a grammar that has terminated, and builds the
    final `RequestOutput`.
    """

    def __init__(self, tokenizer, structured=None) -> None:
        self.tokenizer = tokenizer
        self.structured = structured

    def add(self, seq: Sequence) -> None:
        p = seq.params
        if p.stop:
            # Only stop strings need text while generating; other requests are decoded once at the end.
            seq.extra["detok"] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
            )
        if self.structured is not None and p.constrained:
            seq.extra["grammar"] = self.structured.new_matcher(p)

    def process(self, seq: Sequence, token_id: int) -> str | None:
        """Feed a newly sampled token; return a finish reason when the request must stop now."""
        reason = None
        grammar = seq.extra.get("grammar")
        if grammar is not None:
            self.structured.accept(grammar, token_id)
            if self.structured.is_terminated(grammar):
                reason = "stop"
        detok: IncrementalDetokenizer | None = seq.extra.get("detok")
        if detok is not None:
            detok.add_token(token_id)
            if detok.stopped:
                reason = "stop"
        return reason

    def build_output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        detok: IncrementalDetokenizer | None = seq.extra.pop("detok", None)
        if detok is not None:
            detok.finish()
            text = detok.text
        else:
            text = decode_output(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids,
                                 seq.params.skip_special_tokens)
        seq.extra.pop("grammar", None)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason or "length",
            logprobs=seq.logprobs,
            seed=seq.seed,
            metrics={"num_cached_tokens": seq.num_cached_tokens, "num_preemptions": seq.num_preemptions},
        )
