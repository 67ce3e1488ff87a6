"""Progress for the commands that can take more than a few seconds (a traced model's description, explain's
re-simulations, sweeps, max-batch searches, real validate runs): a rich bar or spinner on stderr when stderr is a
terminal, nothing at all otherwise (pipes, files, CI logs and --json output stay byte for byte the same).

    with progress("re-simulating fixes", total=len(candidates)) as p:
        for c in candidates:
            ...
            p.advance()

`total=None` shows a spinner with the elapsed time (a step whose length is not known in advance).

The Python API draws nothing: its long calls (`run`, `explain`, `max_micro_batch`, `where`) take `progress=`, a
callable `progress(i, n, what)` called before the i-th (0-based) of n steps (n None: not known in advance), and log
the same as INFO records on the "peakledger" logger (`reporter`), silent unless the application configures
logging. A `progress` bar is such a callable too: the CLI passes its bar to the API.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

Progress = Callable[[int, "int | None", str], None]  # progress(i, n, what): before the i-th of n steps
LOG = logging.getLogger("peakledger")


def reporter(callback: Progress | None) -> Progress:
    """The API's progress: an INFO record on the "peakledger" logger, then `callback(i, n, what)` if given."""
    def report(i: int, n: int | None, what: str) -> None:
        LOG.info("%s (%d of %s)", what, i + 1, "?" if n is None else n)
        if callback is not None:
            callback(i, n, what)
    return report


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

    def __call__(self, i: int, n: int | None, what: str) -> None:
        """The API's progress callback (`Progress`): the bar at step i of n, described by `what`."""
        if self.bar is not None:
            self.bar.update(self.task, completed=i, description=what, **({"total": n} if n is not None else {}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["progress", "reporter", "Progress", "LOG"]
