"""What a command made, kept alive until the process exits, where the `peakledger` command runs: `cli.entry` ends
with `os._exit`, which frees nothing, so freeing a run's report and op graph object by object when the command's
function returns is work for nobody (0.35 s of the 2,048-rank simulate's 5.7 s, after its answer was printed).
Elsewhere (the Python API, `main()` called from a test or a script) nothing is kept: `keep` does nothing there."""

from __future__ import annotations

_KEPT: list[object] | None = None  # None: not under cli.entry


def keeping() -> None:
    """From now on `keep` keeps (cli.entry, before the command runs)."""
    global _KEPT
    _KEPT = []


def keep(*objects: object) -> None:
    """Keep `objects` alive until the exit, under cli.entry; elsewhere nothing."""
    if _KEPT is not None:
        _KEPT.extend(objects)


__all__ = ["keep", "keeping"]
