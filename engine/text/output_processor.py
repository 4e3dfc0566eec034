"""Turns a request's sampled tokens into its text and builds its `RequestOutput`."""

from __future__ import annotations

from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, decode_output
from deepinfer.engine.text.tokenizer import Tokenizer


class OutputProcessor:
    """Per-request detokenization: the incremental detokenizer of requests with stop strings (the finish
    rules in core/finish.py feed it and read its stop-string match) and the final `RequestOutput`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

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
        """The finished request's output (its text, truncated at a matched stop string)."""
        detok, seq.detokenizer = seq.detokenizer, None
        if detok is not None:
            detok.finish()
            text = detok.text
        else:
            text = decode_output(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids,
                                 seq.params.skip_special_tokens)
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
