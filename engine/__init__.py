"""deepinfer's engine: `from deepinfer.engine import LLM, SamplingParams`."""

from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so light users (the CLI's
    # `validate`, which must not import torch) can import SamplingParams cheaply.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
