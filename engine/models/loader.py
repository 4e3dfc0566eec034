"""Find a model directory and stream its weights to the target device.

Weights come from safetensors straight onto the device (no full CPU copy): on CUDA through big sequential
reads into pinned buffers (safetensors_stream.py; DEEPINFER_WEIGHT_READER=safe_open selects the old
one-tensor-at-a-time safe_open path), on CPU through safe_open. Pickle checkpoints (*.bin / *.pt) can run
arbitrary code when loaded, so they are refused unless the caller opts in; even then they load with
`torch.load(weights_only=True)`.

torch is imported where it is used: the job driver resolves the model directory and checks its weight
files (weight_files) without importing torch, which would cost it seconds before the output is opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from deepinfer.engine.models.config import ModelConfig

MODEL_DIR_ENV = "DEEPINFER_HF_MODEL_DIR"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# Spelling of a dtype (config.json, the dtype argument) -> torch dtype name.
_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
WEIGHT_READER_ENV = "DEEPINFER_WEIGHT_READER"
_EXPLICIT_DTYPES = ("bfloat16", "float16", "float32")


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _from_hf_cache(repo_id: str, cache_dir: Path) -> Path | None:
    """The cached snapshot of `repo_id` (local files only; never touches the network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache_dir), local_files_only=True))
    except Exception:  # not cached, not a valid repo id, ...: the caller reports what was tried
        return None


def resolve_model_dir(model: str) -> Path:
    """A model directory for `model`, tried in order:

    "demo" (the built-in random-weight demo model); a local directory; `$DEEPINFER_HF_MODEL_DIR/<model>`
    when that variable is set; a Hugging Face repo id in the local HF cache (no network). ValueError
    naming every place tried when none has it.
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"model={model!r}: expected a directory path or a Hugging Face repo id")
    if model == "demo":
        from deepinfer.engine.models.demo import demo_model_dir

        return demo_model_dir()
    tried = []
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    why = "a file, not a directory" if local.is_file() else "does not exist"
    tried.append(f"local directory {str(local)!r} ({why})")
    env_root = os.environ.get(MODEL_DIR_ENV)
    if env_root:
        candidate = Path(env_root).expanduser() / model
        if candidate.is_dir():
            return candidate
        tried.append(f"${MODEL_DIR_ENV}/{model} = {str(candidate)!r} (does not exist)")
    else:
        tried.append(f"${MODEL_DIR_ENV} (not set)")
    cache = hf_hub_cache_dir()
    cached = _from_hf_cache(model, cache)
    if cached is not None and cached.is_dir():
        return cached
    tried.append(f"Hugging Face cache {str(cache)!r} (no snapshot of repo {model!r}; never downloaded)")
    raise ValueError(f"model {model!r} not found; tried: " + "; ".join(tried))


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (float32 when unrecorded); or "bfloat16" / "float16" / "float32"."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
        raise ValueError(f"dtype={dtype}: expected 'auto', {', '.join(_EXPLICIT_DTYPES)}")
    if dtype == "auto":
        if cfg.torch_dtype is None:
            return torch.float32
        name = cfg.torch_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"config.json dtype {cfg.torch_dtype!r} is not supported; pass dtype= one of "
                             f"{', '.join(_EXPLICIT_DTYPES)}")
        return getattr(torch, _DTYPES[name])
    if dtype in _EXPLICIT_DTYPES:
        return getattr(torch, _DTYPES[dtype])
    raise ValueError(f"dtype={dtype!r}: expected 'auto', {', '.join(_EXPLICIT_DTYPES)}")


def _indexed_files(model_dir: Path, index_name: str) -> list[Path]:
    index_path = model_dir / index_name
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_path}: unreadable weight index ({e!r})") from e
    files = [model_dir / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index_path} names weight files that are missing: {', '.join(missing)}")
    return files


def weight_files(model_dir: str | Path, allow_pickle: bool = False) -> tuple[str, list[Path]]:
    """("safetensors" | "pickle", the weight files). ValueError when none exist or pickle is refused."""
    model_dir = Path(model_dir)
    if (model_dir / SAFETENSORS_INDEX).is_file():
        return "safetensors", _indexed_files(model_dir, SAFETENSORS_INDEX)
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return "safetensors", found
    if (model_dir / PICKLE_INDEX).is_file():
        pickles = _indexed_files(model_dir, PICKLE_INDEX)
    else:
        pickles = sorted([*model_dir.glob("*.bin"), *model_dir.glob("*.pt")])
    if pickles:
        if not allow_pickle:
            raise ValueError(
                f"{model_dir} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}), which "
                "can run arbitrary code when loaded; convert them to safetensors, or opt in with "
                "allow_pickle=True"
            )
        return "pickle", pickles
    raise ValueError(f"{model_dir}: no weight files (*.safetensors, or {SAFETENSORS_INDEX})")


def iter_weights(model_dir: str | Path, device: torch.device | str, allow_pickle: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every checkpoint tensor, each loaded straight onto `device`.

    The files are checked (and pickle refused) when this is called, before the first tensor is read.
    """
    import torch

    kind, files = weight_files(model_dir, allow_pickle)
    return _iter_files(kind, files, torch.device(device))


def weight_reader(device: torch.device) -> str:
    """"stream" (safetensors_stream: pinned buffers, the default on CUDA) or "safe_open" (CPU, or
    $DEEPINFER_WEIGHT_READER=safe_open); ValueError for another value of that variable."""
    choice = os.environ.get(WEIGHT_READER_ENV, "").strip().lower() or None
    if choice not in (None, "stream", "safe_open"):
        raise ValueError(f"${WEIGHT_READER_ENV}={choice!r}: expected 'stream' or 'safe_open' (or unset)")
    if choice is None:
        return "stream" if device.type == "cuda" else "safe_open"
    return choice


def _iter_files(kind: str, files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    if kind == "safetensors" and weight_reader(device) == "stream":
        from deepinfer.engine.models.safetensors_stream import stream_safetensors

        yield from stream_safetensors(files, device)
    elif kind == "safetensors":
        from safetensors import safe_open

        for path in files:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
    else:
        for path in files:
            state = torch.load(str(path), map_location=device, weights_only=True)
            if not isinstance(state, dict):
                raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
            yield from state.items()
            del state
