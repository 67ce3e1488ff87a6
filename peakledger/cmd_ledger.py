"""`peakledger ledger`: (being built)."""

from __future__ import annotations


def register(sub) -> None:
    """Adds the `ledger` sub-command (none yet)."""
