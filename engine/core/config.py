"""Engine configuration: frozen dataclasses validated when built (ValueError says what to change)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256                 # sequences in one step at most
    max_num_batched_tokens: int = 8192      # tokens (prefill chunks + decodes) in one step at most
    max_model_len: int = 4096               # prompt + output tokens of one sequence at most
    enable_chunked_prefill: bool = True     # split long prompts across steps under the token budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len} "
                "needs enable_chunked_prefill=True (or raise max_num_batched_tokens)"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                    # tokens per KV block (a multiple of the attention KV chunk)
    num_blocks: int | None = None           # None: sized from free device memory / cpu_kv_cache_gib
    gpu_memory_utilization: float = 0.90    # CUDA: share of total device memory the engine may use
    cpu_kv_cache_gib: float = 1.0           # CPU: KV cache size when num_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks}: must be >= 1 or None")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib={self.cpu_kv_cache_gib}: must be > 0")
