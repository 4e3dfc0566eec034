"""FP8 KV cache settings: the cache dtype for `kv_cache_dtype=`, and which models can hold one.

Scales (documented choice): one static float32 scale per (layer, kv head) for keys and one for values,
all 1.0 (the stored value is clamp(k / scale, +-448) rounded to nearest e4m3; reads multiply back). Static
and data-independent on purpose: a scale fitted to "the first prefill" would make a request's bits depend
on which request came first, breaking the batch-invariance guarantee. With scale 1.0 e4m3 keeps ~2 significant
digits (3 mantissa bits) over 2^-9 .. 448, enough for post-RoPE keys and values of the models served here;
checkpoint `k_scale`/`v_scale` tensors are not read yet. The scales live on each attention layer
(`PagedSelfAttention.k_scale` / `v_scale`), so per-head calibration can be loaded into them later without
touching the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from deepinfer.engine.models.quant.fp8_format import check_kv_cache_dtype
from deepinfer.engine.models.quant.fp8_tensor import FP8_DTYPE


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the KV cache: the model dtype for "auto", e4m3 for "fp8"."""
    return FP8_DTYPE if check_kv_cache_dtype(kv_cache_dtype) == "fp8" else model_dtype


def check_kv_layout(model: Any, kv_dtype: torch.dtype) -> None:
    """ValueError when an FP8 cache is asked of a model whose cache layout cannot hold one yet (MLA)."""
    if kv_dtype == FP8_DTYPE and getattr(model, "kv_cache_spec", None) is not None:
        raise ValueError(f"kv_cache_dtype='fp8' is not supported for {model.config.architecture} (its latent "
                         "MLA cache has no FP8 path yet); use kv_cache_dtype='auto'")
