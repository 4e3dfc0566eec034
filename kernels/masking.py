"""Token-bitmask application for the engine: the Triton kernel on CUDA, plain torch elsewhere.

Triton is imported only when a CUDA tensor is masked, so CPU engines never need it.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.token_mask import apply_token_bitmask_torch_


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         row_indices: torch.Tensor | None = None) -> None:
    """Set logits[r, v] = -inf wherever bit v of bitmask row r is clear, for r in row_indices (or all rows).

    logits: float [S, V] (fp32/bf16/fp16), modified in place. bitmask: int32 [S, ceil(V/32)] on the same
    device. row_indices: int64/int32 [R] on the same device, or None for every row.
    """
    if logits.is_cuda:
        from deepinfer.kernels.token_mask import apply_token_bitmask_triton_

        apply_token_bitmask_triton_(logits, bitmask, row_indices)
    else:
        apply_token_bitmask_torch_(logits, bitmask, row_indices)
