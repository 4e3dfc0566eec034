"""deepinfer's Triton kernels (CUDA), each batch-invariant and paired with a plain-torch `*_ref` reference.

Modules: matmul (bi_linear), rmsnorm (rms_norm), activation (silu_and_mul), store_kv (store_kv),
paged_attention (paged_attention, store_kv), fp8_matmul (quantize_act, fp8_linear, fp8_grouped_linear),
fp8_rowwise (fp8_rowwise_linear, fp8_rowwise_linear_quantized, RowwisePlanner), fp8_rowwise_tma and
fp8_block_tma (the FP8 GEMMs with TMA tile loads), bucket_planner (BucketPlanner: M-bucket tiles proven
bitwise equal on the device first), fp8_row_quant (quantize_rows),
fp8_fused_quant (rms_norm_quant, silu_and_mul_quant: the activation quantization fused into its
producer), fp8_group_quant (the same per token and K-group, for the block-scaled GEMM), fp8_block_plan
(block_linear, BlockPlanner: the block-scaled GEMM's proven M-bucket tiles, its data-driven table),
fp8_moe (fp8_fused_moe), kv_fp8 (store_kv_fp8), MLA:
store_mla, mla_proj (head_proj), mla_decode (mla_decode, split-KV), MoE:
fused_moe (fused_moe, moe_align, combine_rows), row_sum (row_sum_in_order: the invariant routers' row
sums in one launch), DeepSeek-V4: v4_attention (v4_sink_attention, gathered sink attention
by slot), v4_indexer (indexer_scores, the Lightning Indexer). Importing this package does not import
Triton; import the kernel modules only after `triton_available()` says they can run.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when Triton is importable and a CUDA device is present (the kernels can run for real)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. missing CUDA libraries) counts as unavailable
        return False
    return True
