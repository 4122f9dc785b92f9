"""What the CLI shows of long work: rich bars on a terminal, log lines everywhere else.

A bar alone says nothing where there is no terminal (CI, ``nohup``, a pipe): there each bar
becomes a line when it starts, one at most every ``every`` seconds while it moves, and one when
it ends, each with its seconds; a stage with no count (loading, decoding an image) is a line
when it starts and one when it ends. Export's bar is weighted by each graph's parameters
(export/onnx_export.ExportEvent), so it moves as the work does and its ETA is not frozen on the
one graph that takes 80% of the time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[int], None]


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class Reporter:
    """Bars (``bar(total, description)``), stages (``stage(name)``) and export events for one
    command; on a terminal rich draws them, elsewhere :meth:`line` prints them."""

    def __init__(self, console: Console, every: float = 10.0):
        self.console = console
        self.tty = console.is_terminal
        self.every = every
        self.bars = Progress(
            TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=console, disable=not self.tty, transient=False,
        )  # fmt: skip
        self._export_task: Optional[int] = None
        self._export_start = 0.0

    def line(self, text: str) -> None:
        """A plain line where no bar is drawn (on a terminal the bars say it)."""
        if not self.tty:
            self.console.print(text, markup=False, highlight=False)

    def __call__(self, total: int, description: str) -> Advance:
        """A bar of ``total`` units; returns ``advance(n)`` (the progress factory the bench,
        quality and run functions take)."""
        return self.bar(total, description)

    def bar(self, total: int, description: str) -> Advance:
        """A bar of ``total`` units; returns ``advance(n)``."""
        task = self.bars.add_task(description, total=total)
        start = last = time.perf_counter()
        done = 0
        self.line(f"{description}: 0/{total}")

        def advance(n: int) -> None:
            nonlocal done, last
            self.bars.advance(task, n)
            done += n
            now = time.perf_counter()
            if done >= total or now - last >= self.every:
                last = now
                self.line(f"{description}: {done}/{total} ({now - start:.1f} s)")

        return advance

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Work with no count (loading the graphs, decoding): a line as it starts and ends."""
        start = time.perf_counter()
        self.line(f"{name} ...")
        task = self.bars.add_task(name, total=None)
        try:
            yield
        finally:
            self.bars.update(task, total=1, completed=1)
        self.line(f"{name}: done ({time.perf_counter() - start:.1f} s)")

    def export_event(self, event: Any) -> None:
        """One export/onnx_export.ExportEvent: a graph starting (``seconds`` None) or done."""
        if self._export_task is None:
            self._export_task = self.bars.add_task("export", total=event.total)
            self._export_start = time.perf_counter()
        if event.seconds is None:
            self.bars.update(self._export_task, description=event.graph)
            self.line(f"export: {event.graph} ({event.weight / 1e6:.1f} M parameters) ...")
            return
        self.bars.advance(self._export_task, event.weight)
        self.line(f"export: {event.graph} done in {event.seconds:.1f} s ({human_bytes(event.bytes_written)} written; "
                  f"{time.perf_counter() - self._export_start:.0f} s in all)")  # fmt: skip


@contextmanager
def reporter(console: Console) -> Iterator[Reporter]:
    rep = Reporter(console)
    with rep.bars:
        yield rep
