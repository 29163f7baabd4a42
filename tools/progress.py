"""The tools' console and progress display: rich's live bar on a terminal, plain lines in a log.

On an interactive terminal rich redraws its bar in place. When stdout is a file, a pipe or
a CI log, rich draws nothing until the end, so a long run looks hung; there the same rich
columns (without the bar) are printed as one plain line every :data:`LOG_EVERY` seconds
instead, and once more at the end.

Every tool prints to a :func:`tool_console`, which never breaks a printed line: in a file
rich takes the width as 80 columns, and a verdict broken there ("CHECK PASSED (... limit" /
"rel 0.05)") is half found by a grep of the log.
"""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: Seconds between two progress lines when the console is not an interactive terminal.
LOG_EVERY = 5.0


def tool_console(**kwargs) -> Console:
    """The console a tool prints to: rich's (``kwargs`` as for :class:`rich.console.Console`),
    with soft wrapping, so that a line printed is never broken at the console's width (a
    terminal wraps it on screen; a log keeps it whole); tables still fit the width."""
    return Console(soft_wrap=True, **kwargs)


class ToolProgress(Progress):
    """A :class:`rich.progress.Progress` of one kind of work (``what``: "decode", "cells")
    with the columns description, bar (terminal only), done/total, the task's ``info``
    field and the elapsed time.

    Args:
      what: the description column's text.
      console: where to draw; its ``is_interactive`` picks the live bar or the plain lines.
      every: seconds between two plain lines (not on a terminal).
    """

    def __init__(self, what: str, console: Console, every: float = LOG_EVERY):
        interactive = console.is_interactive
        columns = [TextColumn(f"[bold]{what}"), *([BarColumn()] if interactive else []),
                   MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        super().__init__(*columns, console=console, auto_refresh=interactive)
        self.every = every
        self._done = threading.Event()
        self._lines = None if interactive else threading.Thread(
            target=self._print_lines, name="progress-lines", daemon=True)

    def add_task(self, description: str = "", *args, info: str = "", **kwargs):
        return super().add_task(description, *args, info=info, **kwargs)

    def start(self) -> None:
        super().start()
        if self._lines is not None:
            self._lines.start()

    def stop(self) -> None:
        if self._lines is not None and self._lines.is_alive():
            self._done.set()
            self._lines.join()
        super().stop()

    def _print_lines(self) -> None:
        while not self._done.wait(self.every):
            with self._lock:
                line = self.make_tasks_table(self.tasks)
            self.console.print(line)
