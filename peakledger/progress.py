"""Progress for the commands that can take more than a few seconds (a traced model's description, explain's
re-simulations, sweeps, max-batch searches, real validate runs): a rich bar or spinner on stderr when stderr is a
terminal, nothing at all otherwise (pipes, files, CI logs and --json output stay byte for byte the same).

    with progress("re-simulating fixes", total=len(candidates)) as p:
        for c in candidates:
            ...
            p.advance()

`total=None` shows a spinner with the elapsed time (a step whose length is not known in advance).
"""

from __future__ import annotations

import sys


class progress:
    """A context manager: the bar or spinner is taken down (and the cursor restored) on every exit path."""

    def __init__(self, description: str, total: int | None = None, enabled: bool = True) -> None:
        self.bar = None
        self.task = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console  # rich, loaded only for a terminal (it adds to every CLI start)
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if total is not None:
                columns += [BarColumn(), MofNCompleteColumn()]
            self.bar = Progress(*columns, TimeElapsedColumn(), transient=True, console=Console(stderr=True),
                                redirect_stdout=False, redirect_stderr=False)  # (stdout stays the command's)
            self.bar.start()
            self.task = self.bar.add_task(description, total=total)

    def advance(self, n: int = 1, description: str | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n, **({"description": description} if description else {}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["progress"]
