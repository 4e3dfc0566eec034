"""safetensors_stream (big reads into host buffers, copied into per-tensor device memory) yields exactly the
tensors safe_open does: every dtype, odd byte offsets, tensors split over many chunks, several files, and
files it does not take (fallback). On CPU with plain buffers; the GPU test uses pinned ones."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer.engine.models.loader import iter_weights, weight_reader
from deepinfer.engine.models.safetensors_stream import _chunks, read_header, stream_safetensors
from safetensors import safe_open
from safetensors.torch import save_file


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.bf16": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(1000, generator=g),
        "c.u8": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),   # odd size: later offsets odd
        "d.f16": torch.randn(3, 5, 7, generator=g).to(torch.float16),
        "e.i64": torch.randint(-(2**40), 2**40, (11,), generator=g),
        "f.bool": torch.rand(13, generator=g) > 0.5,
        "g.scalar": torch.tensor(3.5),
        "h.empty": torch.zeros(0, 4),
        "i.i32": torch.randint(-9, 9, (5, 2), generator=g, dtype=torch.int32),
        "j.f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "k.nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def _by_safe_open(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert y.is_contiguous(), name
        # Bytes, not values: NaN payloads, -0.0 and float8 all compared exactly.
        assert torch.equal(x.contiguous().view(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("st")
    out = []
    for i in range(2):
        p = root / f"model-{i:05d}-of-00002.safetensors"
        save_file(_tensors(i), str(p), metadata={"format": "pt"})
        out.append(p)
    return out


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("chunk", [1 << 20, 64, 7, 1])
def test_stream_yields_the_safe_open_tensors_bit_for_bit(files, chunk, readers):
    want = {f"{i}/{k}": v for i, p in enumerate(files) for k, v in _by_safe_open(p).items()}
    got = {}
    for name, t in stream_safetensors(files, "cpu", chunk_bytes=chunk, num_buffers=2 * readers,
                                      num_readers=readers):
        key = next(f"{i}/{name}" for i in range(len(files)) if f"{i}/{name}" not in got)
        got[key] = t
    _same(want, got)


def test_header_offsets_and_chunk_cover(files):
    entries = read_header(files[0])
    assert entries is not None and [e.start for e in entries] == sorted(e.start for e in entries)
    assert any(e.start % 2 for e in entries)   # the uint8 tensor leaves later tensors at odd offsets
    for size in (1, 5, 64, 1 << 20):
        ranges = _chunks(entries, size)
        assert all(0 < hi - lo <= size for lo, hi in ranges)
        covered = sum(hi - lo for lo, hi in ranges)
        assert covered == sum(e.end - e.start for e in entries)   # the tensors are contiguous in the file


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_unknown_dtype_or_bad_offsets_fall_back_to_safe_open(tmp_path, files):
    bad = _write_raw(tmp_path / "bad.safetensors",
                     {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8)
    assert read_header(bad) is None   # 2 float32 need 8 bytes, the header says 4
    odd = _write_raw(tmp_path / "odd.safetensors",
                     {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    assert read_header(odd) is None
    got = dict(stream_safetensors([files[0]], "cpu", chunk_bytes=16))
    _same(_by_safe_open(files[0]), got)


def test_truncated_file_raises_and_stops_the_reader(tmp_path, files):
    data = files[0].read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data)
    entries = read_header(cut)
    assert entries is not None
    # Truncate after the header check: the reader must report the short read, not hang or yield garbage.
    it = stream_safetensors([cut], "cpu", chunk_bytes=64)
    assert next(it)[0] == "h.empty"   # zero-byte tensors come first, before any read
    cut.write_bytes(data[: entries[-1].start])
    with pytest.raises(OSError, match="file ended"):
        list(it)


def test_loader_picks_the_reader(monkeypatch):
    monkeypatch.delenv("DEEPINFER_WEIGHT_READER", raising=False)
    assert weight_reader(torch.device("cpu")) == "safe_open"
    assert weight_reader(torch.device("cuda", 0)) == "stream"
    monkeypatch.setenv("DEEPINFER_WEIGHT_READER", "safe_open")
    assert weight_reader(torch.device("cuda", 0)) == "safe_open"
    monkeypatch.setenv("DEEPINFER_WEIGHT_READER", "stream")
    assert weight_reader(torch.device("cpu")) == "stream"
    monkeypatch.setenv("DEEPINFER_WEIGHT_READER", "mmap")
    with pytest.raises(ValueError, match="DEEPINFER_WEIGHT_READER"):
        weight_reader(torch.device("cpu"))


def test_iter_weights_stream_equals_safe_open_on_cpu(monkeypatch, files, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(files[1].read_bytes())
    monkeypatch.setenv("DEEPINFER_WEIGHT_READER", "stream")
    streamed = dict(iter_weights(d, "cpu"))
    monkeypatch.setenv("DEEPINFER_WEIGHT_READER", "safe_open")
    _same(dict(iter_weights(d, "cpu")), streamed)


def test_driver_side_checks_do_not_import_torch(files):
    # The job driver resolves the model and checks its weight files before the output is opened.
    code = ("import sys; from deepinfer.engine.models.loader import weight_files, resolve_model_dir; "
            f"weight_files(resolve_model_dir({str(files[0].parent)!r})); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stream_to_cuda_through_pinned_buffers_is_bit_exact(files):
    # Two files share the pinned buffers: the second file's reads must wait for the first one's copies.
    want = []
    for p in files:
        with safe_open(str(p), framework="pt", device="cuda") as f:
            want.append({name: f.get_tensor(name).cpu() for name in f.keys()})  # noqa: SIM118
    for chunk, readers in ((1 << 20, 4), (64, 3), (7, 2)):
        got = list(stream_safetensors(files, "cuda", chunk_bytes=chunk, num_buffers=2 * readers,
                                      num_readers=readers))
        assert all(t.device.type == "cuda" for _, t in got)
        torch.cuda.synchronize()
        n0 = len(want[0])   # a file's tensors all come before the next file's
        _same(want[0], {n: t.cpu() for n, t in got[:n0]})
        _same(want[1], {n: t.cpu() for n, t in got[n0:]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llm_loads_the_same_parameters_with_either_reader(monkeypatch, tiny_checkpoint):
    import gc

    from deepinfer.engine import LLM

    path = str(tiny_checkpoint("llama", dtype=torch.bfloat16))
    params = {}
    for reader in ("safe_open", "stream"):
        monkeypatch.setenv("DEEPINFER_WEIGHT_READER", reader)
        llm = LLM(model=path, dtype="bfloat16", device="cuda", max_model_len=256, num_kv_blocks=64,
                  enable_cuda_graphs=False)
        params[reader] = {n: p.detach().cpu() for n, p in llm.model.named_parameters()}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    _same(params["safe_open"], params["stream"])
