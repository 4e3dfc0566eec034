"""FP8 copies of tiny checkpoints, written in the published formats, and their dequantized twins.

`write_fp8_copy(src, dst, scheme, block)` rewrites every decoder-layer linear weight of `src` as e4m3:
- "block": `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32 beside each weight and `quantization_config
  {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk]}` (DeepSeek-V3's layout; the arithmetic
  of HF transformers' FineGrainedFP8 writer, with DeepSeek's partial edge tiles);
- "channel" / "tensor": `weight_scale` [N, 1] / [1] and a compressed-tensors "float-quantized" config (the
  "FP8-Dynamic" releases).
`write_dequantized_copy(fp8_dir, dst)` writes the float32 checkpoint those weights stand for (w = q * s),
which transformers runs as the reference. The quantizer here is written independently of the engine's (tile by
tile) so that the two can be compared.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR = re.compile(r"^model\.layers\.\d+\..*(_proj|_proj_with_mqa)\.weight$")


def quantize_tiles(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-by-tile block quantizer: (e4m3 weight, weight_scale_inv [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    w = w.to(torch.float32)
    rows, cols = -(-n // bn), -(-k // bk)
    q = torch.empty((n, k), dtype=FP8)
    inv = torch.empty((rows, cols), dtype=torch.float32)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]
            amax = tile.abs().max()
            scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
            inv[r, c] = 1.0 / scale
            q[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = (tile * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, inv


def quantize_rows(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ([N, 1]) or per-tensor ([1]) scales as compressed-tensors writes them: s = amax / 448."""
    w = w.to(torch.float32)
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(1) if per_tensor else scale


def _quant_config(scheme: str, block: tuple[int, int]) -> dict:
    if scheme == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": scheme,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token", "dynamic": True}}}}


def _rewrite(src: Path, dst: Path, convert, config_edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(f)).items():
            out.update(convert(name, t))
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update({name: f.name for name in out})
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (dst / "config.json").write_text(json.dumps(config_edit(cfg), indent=2), encoding="utf-8")
    return dst


def write_fp8_copy(src: str | Path, dst: str | Path, scheme: str = "block",
                   block: tuple[int, int] = (16, 16)) -> Path:
    """An FP8 copy of checkpoint `src` in `dst` (see the module docstring)."""
    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not LINEAR.match(name) or t.dim() != 2:
            return {name: t}
        if scheme == "block":
            q, inv = quantize_tiles(t, *block)
            return {name: q, name.removesuffix(".weight") + ".weight_scale_inv": inv}
        q, s = quantize_rows(t, per_tensor=scheme == "tensor")
        return {name: q, name.removesuffix(".weight") + ".weight_scale": s}

    def edit(cfg: dict) -> dict:
        return {**cfg, "quantization_config": _quant_config(scheme, block)}

    return _rewrite(Path(src), Path(dst), convert, edit)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """w = q * s in float32, for any of the scale layouts above (`block`: the config's weight_block_size)."""
    n, k = q.shape
    if scale.numel() == 1 or scale.shape == (n, 1):
        return q.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    bn, bk = block
    full = scale.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.to(torch.float32) * full


def write_dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """The float32 checkpoint an FP8 copy stands for (scales folded in, quantization_config removed)."""
    from safetensors import safe_open

    src = Path(src)
    qc = json.loads((src / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    block = qc.get("weight_block_size")
    scales: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118
                if name.endswith(("weight_scale_inv", "weight_scale")):
                    scales[name.rsplit(".", 1)[0] + ".weight"] = h.get_tensor(name)

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(("weight_scale_inv", "weight_scale")):
            return {}
        if t.dtype == FP8:
            return {name: dequantize(t, scales[name], block)}
        return {name: t}

    def edit(cfg: dict) -> dict:
        return {k: v for k, v in cfg.items() if k != "quantization_config"}

    return _rewrite(src, Path(dst), convert, edit)
