"""What FP8 a checkpoint carries (`quantization_config` in config.json) and what the engine does with it.

Recognised checkpoint configs:
- `{"quant_method": "fp8", "weight_block_size": [bn, bk]}`: block-scaled e4m3 with `weight_scale_inv`
  (DeepSeek-V3/R1, HF transformers' FineGrainedFP8Config); without `weight_block_size`: per-tensor
  `weight_scale` (older "fp8" releases).
- `{"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {..: {"weights":
  {"num_bits": 8, "type": "float", "strategy": "tensor" | "channel" | "block", ...}}}}`: the "FP8-Dynamic" /
  "FP8" releases of llm-compressor, with `weight_scale` beside each weight. Static `input_scale`s are dropped:
  the engine always quantizes activations per token-group on the fly.

`quantization=` (the `LLM` argument / spec key `model.quantization`):
- None: run in the model dtype; an FP8 checkpoint is dequantized at load.
- "auto": what the checkpoint says: FP8 weights stay FP8 on CUDA (FP8 GEMMs), unquantized ones stay as
  they are.
- "fp8": FP8 GEMMs; an unquantized checkpoint is quantized at load, block-scaled 128 x 128 exactly as
  `quantize_fp8_block` (so the result equals loading an offline-quantized checkpoint).
- "fp8-channel": FP8 GEMMs with one weight scale per output channel; an unquantized checkpoint is quantized
  at load per channel (`quantize_fp8_channel`, the "FP8-Dynamic" arithmetic); a per-channel / per-tensor
  checkpoint as with "auto"; a block-scaled checkpoint is refused (its scales vary along K: use "auto").
Which GEMM: per-channel and per-tensor weights (checkpoint or "fp8-channel") run the rowwise-scaled kernel
(kernels/fp8_rowwise.py: activations quantized per token, both scales applied once after the K loop; the
layer's K-group is its whole K), block-scaled weights the block kernel (kernels/fp8_matmul.py, activations
quantized per token and 128-group). DeepSeek's routed experts stay FP8 only with block scales (grouped FP8
GEMM); with per-channel scales they are dequantized at load.
On CPU FP8 weights are always dequantized at load (the CPU path is the correctness reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANTIZATION_CHOICES = (None, "auto", "fp8", "fp8-channel")
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_BLOCK = (128, 128)
SCHEMES = ("block", "channel", "tensor")


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 weight format: `scheme` block (with `block` = (bn, bk)), channel or tensor."""

    scheme: str
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"Fp8Format.scheme={self.scheme!r}: expected one of {SCHEMES}")
        if (self.scheme == "block") != (self.block is not None):
            raise ValueError("Fp8Format: block=(bn, bk) is given exactly when scheme='block'")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"Fp8Format.block={self.block}: expected two sizes >= 1")


@dataclass(frozen=True)
class QuantPlan:
    """How weights load: `checkpoint` is the checkpoint's FP8 format (None: unquantized); `quantize_at_load`
    quantizes unquantized linear weights with `load_block` (or per channel when `load_scheme` is
    "channel"); `fp8_compute` keeps FP8 weights FP8 (CUDA)."""

    checkpoint: Fp8Format | None
    quantize_at_load: bool
    fp8_compute: bool
    load_block: tuple[int, int] = DEFAULT_BLOCK
    load_scheme: str = "block"

    def __post_init__(self) -> None:
        if self.load_scheme not in ("block", "channel"):
            raise ValueError(f"QuantPlan.load_scheme={self.load_scheme!r}: expected 'block' or 'channel'")

    @property
    def rowwise(self) -> bool:
        """Weights carry one scale per output channel (no scale varies along K): the rowwise FP8 GEMM."""
        if self.checkpoint is not None:
            return self.checkpoint.scheme in ("channel", "tensor")
        return self.load_scheme == "channel"

    def layer_group(self, k: int) -> int:
        """The K-group of a layer with K columns: all of K rowwise, else `group_k`."""
        return k if self.rowwise else self.group_k

    @property
    def group_k(self) -> int:
        """K-group of the FP8 GEMM (activation quantization group and weight-scale granularity)."""
        fmt = self.checkpoint
        if fmt is not None and fmt.scheme == "block":
            return fmt.block[1]
        return self.load_block[1]

    @property
    def touches_weights(self) -> bool:
        return self.checkpoint is not None or self.quantize_at_load


def _compressed_tensors_format(qc: dict[str, Any], source: str) -> Fp8Format:
    if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"{source}: compressed-tensors format {qc.get('format')!r} is not supported; "
                         "deepinfer reads FP8 'float-quantized' checkpoints")
    groups = qc.get("config_groups") or {}
    formats = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(f"{source}: config_groups.{name}.weights is {w}; only 8-bit float (FP8) "
                             "weights are supported")
        strategy = w.get("strategy", "tensor")
        if strategy == "block":
            block = w.get("block_structure")
            formats.add(Fp8Format("block", tuple(int(b) for b in block)))
        elif strategy in ("channel", "tensor"):
            formats.add(Fp8Format(strategy))
        else:
            raise ValueError(f"{source}: weight strategy {strategy!r} is not supported (tensor, channel, "
                             "block)")
    if len(formats) != 1:
        raise ValueError(f"{source}: expected one FP8 weight scheme across config_groups, found "
                         f"{formats or 0}")
    return formats.pop()


def checkpoint_format(raw: dict[str, Any], source: str = "config.json") -> Fp8Format | None:
    """The FP8 format a config.json declares; None for an unquantized checkpoint. ValueError for another
    quantization method (what the engine cannot read) naming it."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{source}: FP8 fmt {qc.get('fmt')!r} is not supported; only e4m3")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Format("tensor")
        return Fp8Format("block", tuple(int(b) for b in block))
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc, source)
    raise ValueError(f"{source}: quant_method {method!r} is not supported; deepinfer reads FP8 checkpoints "
                     "(quant_method 'fp8' or FP8 'compressed-tensors')")


def read_checkpoint_format(model_dir: str | Path) -> Fp8Format | None:
    """checkpoint_format of `model_dir`/config.json."""
    path = Path(model_dir) / "config.json"
    return checkpoint_format(json.loads(path.read_text(encoding="utf-8")), str(path))


def plan_quantization(quantization: str | None, checkpoint: Fp8Format | None, device_type: str) -> QuantPlan:
    """The QuantPlan for `quantization=` (see the module docstring) on a CPU or CUDA device."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r}: expected one of {QUANTIZATION_CHOICES} (None: "
                         "model dtype; 'auto': as the checkpoint says; 'fp8': block-scaled FP8; "
                         "'fp8-channel': per-channel FP8 with the rowwise GEMM)")
    on_cuda = device_type == "cuda"
    if quantization is None:
        return QuantPlan(checkpoint, quantize_at_load=False, fp8_compute=False)
    if quantization == "auto":
        return QuantPlan(checkpoint, quantize_at_load=False, fp8_compute=on_cuda and checkpoint is not None)
    if quantization == "fp8-channel":
        if checkpoint is not None and checkpoint.scheme == "block":
            bn, bk = checkpoint.block
            raise ValueError(f"quantization='fp8-channel': the checkpoint is block-scaled FP8 ({bn}x{bk} "
                             "blocks), which has no per-channel form; use quantization='auto' (block-scaled "
                             "FP8 GEMMs) or None (dequantized)")
        return QuantPlan(checkpoint, quantize_at_load=checkpoint is None, fp8_compute=on_cuda,
                         load_scheme="channel")
    return QuantPlan(checkpoint, quantize_at_load=checkpoint is None, fp8_compute=on_cuda)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """Validate `kv_cache_dtype=`: "auto" (the model dtype) or "fp8" (e4m3 with per-head scales)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
    return kv_cache_dtype
