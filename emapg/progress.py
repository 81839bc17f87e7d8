"""Progress of a long stage on the console: on a terminal, a rich bar (done/total, elapsed, time left, the stage's
own numbers such as the loss); elsewhere (a piped `make demo`, a CI log), where a live bar draws nothing, a plain
line every tenth of the work with the same numbers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

LINES_OFF_TERMINAL = 10  # plain lines per stage where no live bar can be drawn


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class StageProgress:
    """`update(done, status)` after each unit of work; `paused()` around work that prints its own progress."""

    def __init__(self, console: Console, description: str, total: int, lines: bool = True, done: int = 0):
        self.console, self.description, self.total, self.lines = console, description, total, lines
        self.start, self.done_at_start = time.perf_counter(), done  # a resumed stage's rate counts this run's work
        self.next_line = done + 1
        self.bar: Progress | None = None
        if console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                TextColumn("{task.fields[status]}"), console=console, transient=True)
            self.task = self.bar.add_task(description, total=total, completed=done, status="")

    def update(self, done: int, status: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, status=status)
            return
        if self.lines and (done >= self.next_line or done == self.total):
            elapsed = time.perf_counter() - self.start
            worked = done - self.done_at_start
            left = _clock(elapsed / worked * (self.total - done)) if worked > 0 else "?"
            self.console.print(f"{self.description} {done}/{self.total}  {status}  elapsed {_clock(elapsed)}, "
                               f"left {left}", highlight=False)
            self.next_line = done + max(1, self.total // LINES_OFF_TERMINAL)

    @contextmanager
    def paused(self) -> Iterator[None]:
        if self.bar is None:
            yield
            return
        self.bar.stop()
        try:
            yield
        finally:
            self.bar.start()


@contextmanager
def stage_progress(console: Console, description: str, total: int, lines: bool = True,
                   done: int = 0) -> Iterator[StageProgress]:
    """A StageProgress for the duration; `lines=False` where the stage prints a line per unit of its own; `done`:
    the units a resumed stage starts with."""
    progress = StageProgress(console, description, total, lines, done)
    if progress.bar is None:
        yield progress
        return
    with progress.bar:
        yield progress
