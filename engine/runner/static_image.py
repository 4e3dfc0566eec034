"""Integer inputs of a CUDA graph packed in one device tensor, mirrored by a host image.

A captured graph reads fixed addresses, so each step's inputs are written into static buffers before the
replay. Writing them field by field costs one small host -> device copy each; here every field is a view of
one flat int32 tensor and its host image, and `upload` moves the whole image in one copy through a pinned
staging buffer (a ring of two, each reused only once its last copy ran, so a copy still in flight is never
overwritten). On CPU the image is the device tensor itself and `upload` does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

_WORDS = {np.dtype(np.int32): 1, np.dtype(np.int64): 2}   # int32 units per element
_TORCH = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class StaticImage:
    """Named int32/int64 fields of fixed shapes; `host[name]` (numpy) and `device[name]` (torch) are views.

    fields: (name, shape, dtype); int64 fields start at even int32 offsets (8-byte aligned views)."""

    def __init__(self, fields: Sequence[tuple[str, tuple[int, ...], type]], device: torch.device) -> None:
        spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape, dtype in fields:
            words = _WORDS[np.dtype(dtype)]
            offset += offset % words
            size = int(np.prod(shape, dtype=np.int64)) * words
            spans[name] = (offset, offset + size)
            offset += size
        self._spans = spans
        self.image = np.zeros(offset, dtype=np.int32)
        # On CPU the image itself is the device buffer: nothing to copy.
        flat = torch.from_numpy(self.image)
        self._flat = flat if device.type == "cpu" else flat.to(device)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, shape, dtype in fields:
            lo, hi = spans[name]
            np_dtype = np.dtype(dtype)
            self.host[name] = self.image[lo:hi].view(np_dtype).reshape(shape)
            self.device[name] = self._flat[lo:hi].view(_TORCH[np_dtype]).view(shape)
        self._cuda = self._flat.is_cuda
        self._ring: list[list] = []   # [pinned staging, event recorded after its last copy, ever copied]
        self._next = 0

    @property
    def nbytes(self) -> int:
        return self.image.nbytes

    def upload(self, parts: Mapping[str, int] | None = None) -> None:
        """Copy the image to the device, asynchronously on the current stream: all of it, or for each field
        of `parts` its first n entries along the first axis (rows of a 2-D field), the rest of the device
        buffers keeping what they hold (a step that fills a prefix of large buffers moves that prefix)."""
        if not self._cuda:
            return   # the image is the buffer
        if not self._ring:
            self._ring = [[torch.empty(self.image.shape, dtype=torch.int32, pin_memory=True),
                           torch.cuda.Event(), False] for _ in range(2)]
        slot = self._ring[self._next % 2]
        self._next += 1
        staging, event, used = slot
        if used:
            event.synchronize()   # its copy of two steps ago: finished long since
        for lo, hi in self._ranges(parts):
            staging.numpy()[lo:hi] = self.image[lo:hi]
            self._flat[lo:hi].copy_(staging[lo:hi], non_blocking=True)
        event.record()
        slot[2] = True

    def _ranges(self, parts: Mapping[str, int] | None) -> list[tuple[int, int]]:
        """The int32 word ranges `upload` copies, adjacent ones merged."""
        if parts is None:
            return [(0, self.image.shape[0])]
        ranges: list[tuple[int, int]] = []
        for name in sorted(parts, key=lambda k: self._spans[k][0]):
            lo, hi = self._spans[name]
            rows = self.host[name].shape[0]
            n = min(max(parts[name], 0), rows)
            end = lo + (hi - lo) // rows * n
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], end)
            elif end > lo:
                ranges.append((lo, end))
        return ranges
