"""One step's grammar masks: which logits rows are constrained, waiting for their slot fills, applying them.

Built by `StructuredOutputManager.masks_for`; the sampler calls `apply(logits)` (engine/runner/
step_executor.py). The masks live in the manager's slot buffer (mask_slots.py); this waits for the rows still
being filled, narrows the rows short of budget (steering.py) and masks the logits from the slots directly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from deepinfer.kernels.masking import apply_token_bitmask_

if TYPE_CHECKING:
    from deepinfer.engine.structured.manager import GrammarState, StructuredOutputManager

# (row index in the bitmask, the request's grammar state, its remaining token budget or None)
MaskRow = tuple[int, "GrammarState", "int | None"]


class StepMasks:
    """The masks of one step: rows of the logits and the slots their masks are (being) filled in."""

    def __init__(self, manager: StructuredOutputManager, rows: list[MaskRow]) -> None:
        self._manager = manager
        self._rows = rows
        self.rows = [r for r, _, _ in rows]
        self._ready = False

    @property
    def bitmask(self) -> torch.Tensor:
        """int32 [len(rows), words]: the step's masks in row order (a copy; for inspection and tests)."""
        self.wait()
        return self._manager.slots.buffer[[st.slot for _, st, _ in self._rows]].clone()

    def wait(self) -> None:
        """Wait for the rows still being filled, then narrow the rows short of budget (steering)."""
        if self._ready:
            return
        m = self._manager
        t0 = time.perf_counter()
        for _, st, _ in self._rows:
            if st.fill is not None:
                st.fill.result()
        waited = time.perf_counter() - t0
        m.wait_seconds += waited
        m.mask_steps += 1
        m.mask_rows += len(self._rows)
        m.record_step(waited, len(self._rows))
        if m.steering is not None:
            view = m.slots.buffer.numpy()
            for _, st, remaining in self._rows:
                if remaining is None or remaining > st.steer_below or st.matcher.is_terminated():
                    continue
                if st.steered:  # narrowed before from this same state: start again from its grammar mask
                    st.matcher.fill_bitmask(m.slots.buffer[st.slot])
                st.steered = True
                if st.lex is not None:
                    m.steering.steer_json_(view[st.slot], st.lex)
                else:
                    m.steering.steer_lookahead_(view[st.slot], st.matcher)
        self._ready = True

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for the fills, then set disallowed logits of the constrained rows to -inf (in place)."""
        self.wait()
        slots = self._manager.slots
        index = torch.tensor([self.rows, [st.slot for _, st, _ in self._rows]], dtype=torch.int64)
        if logits.device.type == "cpu":
            apply_token_bitmask_(logits, slots.buffer, index[0], index[1])
            return
        # Only the slot rows up to the highest one used travel; pinned, so the copies are asynchronous.
        hi = int(index[1].max()) + 1
        bitmask = slots.buffer[:hi].to(logits.device, non_blocking=True)
        index = index.pin_memory().to(logits.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        slots.copied(done)
        apply_token_bitmask_(logits, bitmask, index[0], index[1])
