"""deepinfer's engine: `from deepinfer.engine import LLM, SamplingParams`."""

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sample.params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so light users (the CLI's
    # `validate`, which must not import torch) can import SamplingParams cheaply.
    if name == "LLM":
        from deepinfer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
