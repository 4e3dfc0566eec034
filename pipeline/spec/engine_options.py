"""Model-section engine settings that live outside load.py: FP8 weights, the KV-cache dtype and the
tensor-parallel size.

`EngineOptions` is a keyword-only dataclass base of `load.ModelSpec`, so these fields come with defaults
after ModelSpec's own; `engine_options()` is what they add to `LLM(...)`'s arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    quantization: str | None = "auto"   # model.quantization: auto | fp8 | null (engine/models/quant/)
    kv_cache_dtype: str = "auto"        # model.kv_cache_dtype: auto | fp8
    tensor_parallel_size: int = 1       # model.tensor_parallel_size: GPUs one engine spans (engine/parallel/)

    def engine_options(self) -> dict[str, Any]:
        """These settings as `LLM` keyword arguments (tensor_parallel_size only when above 1)."""
        options: dict[str, Any] = {"quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}
        if self.tensor_parallel_size != 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        return options
