"""deepinfer's engine: `from deepinfer.engine import LLM, SamplingParams` (vLLM's offline API names)."""

from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sample.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so light users (the CLI's
    # `validate`, which must not import torch) can import SamplingParams cheaply.
    if name == "LLM":
        from deepinfer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
