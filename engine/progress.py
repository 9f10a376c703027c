"""Start-up that talks: the phases of loading a model, as a progress bar on a terminal, a line each otherwise.

Why: parsing a GGUF and repacking its weights takes seconds to tens of seconds on a small machine;
without a word the person at the terminal (or reading `tandem up`'s output) cannot tell a slow start
from a hung one. The loader reports phases and steps here; where stderr is a terminal, ``rich`` draws
a bar, else each phase is one line on stderr (what `tandem up` echoes from its children).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LoadProgress:
    """Phases of one model load; ``label`` starts every line (e.g. the worker's id)."""

    def __init__(self, label: str, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def phase(self, what: str, total: int = 0) -> None:
        """A new phase; with ``total`` steps, a bar on a terminal (``step`` advances it)."""
        self._close_bar()
        if self.quiet:
            return
        if total and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn(f"{self.label}: {what}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(what, total=total)
        else:
            self.say(what + (f" ({total} steps)" if total else ""))

    def step(self, n: int = 1) -> None:
        """One step of the current phase done."""
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def done(self, what: str) -> None:
        """The load is over: ``what`` it came to."""
        self._close_bar()
        self.say(f"{what} in {time.monotonic() - self.started:.1f}s")

    def say(self, line: str) -> None:
        if not self.quiet:
            print(f"{self.label}: {line}", file=self.stream, flush=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
