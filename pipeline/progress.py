"""One live progress line for a run: rows done/total, errors, output tokens/s, parts committed, ETA.

On a terminal it is a rich progress bar on stderr; otherwise (CI, Airflow logs) a plain line every
`interval_s` seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressDisplay:
    """Rows advance as result blocks reach the driver (one per part), parts as they are committed."""

    def __init__(self, total_rows: int, done_rows: int, total_parts: int, done_parts: int,
                 label: str = "deepinfer", stream: TextIO | None = None, enabled: bool = True,
                 interval_s: float = 15.0) -> None:
        self.total, self.done = total_rows, done_rows
        self.total_parts, self.done_parts = total_parts, done_parts
        self.errors, self.out_tokens = 0, 0
        self.stream = stream or sys.stderr
        self.enabled, self.interval_s = enabled, interval_s
        self.start = time.monotonic()
        self._last_line = 0.0
        self._start_done = done_rows
        self._rich = None
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total} rows"), TextColumn("{task.fields[errors]} errors"),
                TextColumn("{task.fields[tok_s]:.0f} out tok/s"), TextColumn("parts {task.fields[parts]}"),
                TimeRemainingColumn(), console=Console(file=self.stream), transient=False,
            )
            self._task = self._rich.add_task(label, total=total_rows, completed=done_rows, errors=0,
                                             tok_s=0.0, parts=f"{done_parts}/{total_parts}")
            self._rich.start()

    def tokens_per_second(self) -> float:
        return self.out_tokens / max(time.monotonic() - self.start, 1e-9)

    def eta_seconds(self) -> float | None:
        rate = (self.done - self._start_done) / max(time.monotonic() - self.start, 1e-9)
        return (self.total - self.done) / rate if rate > 0 else None

    def advance(self, rows: int, errors: int, out_tokens: int) -> None:
        self.done += rows
        self.errors += errors
        self.out_tokens += out_tokens
        self._refresh()

    def part_committed(self, errors: int = 0) -> None:
        """A part was committed; `errors` of its rows were quarantined (counted here, once committed)."""
        self.done_parts += 1
        self.errors += errors
        self._refresh()

    def _refresh(self) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, errors=self.errors,
                              tok_s=self.tokens_per_second(), parts=f"{self.done_parts}/{self.total_parts}")
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval_s:
            self._last_line = now
            self._print_line()

    def _print_line(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()

    def line(self) -> str:
        eta = self.eta_seconds()
        eta_text = f"{eta:.0f}s" if eta is not None else "?"
        return (f"[deepinfer] rows {self.done}/{self.total}  errors {self.errors}  "
                f"{self.tokens_per_second():.0f} out tok/s  parts {self.done_parts}/{self.total_parts}  "
                f"ETA {eta_text}")

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self.enabled and self._last_line:
            self._print_line()  # the final state, unless nothing was ever shown
