"""What `LLM(tensor_parallel_size=N)` builds: the checks, then the tensor-parallel driver as the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.parallel.driver import TensorParallelDriver, start_tensor_parallel
from deepinfer.engine.parallel.sharding import ShardPlan
from deepinfer.engine.parallel.worker import ShardArgs


def check_tensor_parallel_size(size: Any) -> int:
    """`tensor_parallel_size` as an int >= 1 (ValueError otherwise)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r}: expected an integer >= 1 (1 = one device)")
    return size


def tensor_parallel_model(size: int, *, model_dir: Path, dtype: torch.dtype, device: torch.device,
                          deterministic: bool, max_model_len: int | None, allow_pickle: bool,
                          quant_plan: Any) -> TensorParallelDriver:
    """Start `size` ranks over `model_dir` (rank 0 here, on `device`; rank r on the r-th next GPU).

    The caller loads the weights through the returned driver (`load_weights` / `init_dummy_weights`)."""
    if getattr(quant_plan, "touches_weights", False):
        raise ValueError("FP8 checkpoints and quantization='fp8' are not supported with "
                         "tensor_parallel_size > 1 yet; use a bf16/fp16/fp32 checkpoint "
                         "and quantization='auto'")
    ShardPlan(ModelConfig.from_dir(model_dir), 0, size)   # shapes the size does not divide fail here, early
    index = device.index if device.type == "cuda" and device.index is not None else 0
    return start_tensor_parallel(ShardArgs(
        model_dir=str(model_dir), dtype=dtype, device_type=device.type, device_index=index,
        deterministic=deterministic, max_model_len=max_model_len, allow_pickle=allow_pickle,
        world_size=size))
