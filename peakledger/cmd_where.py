"""`peakledger where`: (being built)."""

from __future__ import annotations


def register(sub) -> None:
    """Adds the `where` sub-command (none yet)."""
