"""What a tracked log adds up to: the bytes live by category after an event, and the peak."""

from __future__ import annotations

from ...simulator.events import Category, EventLog


def live_bytes(log: EventLog, upto: int | None = None) -> dict[Category, int]:
    """Bytes live by category right after event index `upto` (the whole log by default)."""
    out: dict[Category, int] = {}
    for e in log.events[: None if upto is None else upto + 1]:
        out[e.block.category] = out.get(e.block.category, 0) + e.delta
    return {c: b for c, b in out.items() if b}


def peak(log: EventLog) -> tuple[int, int]:
    """(peak bytes, index of the event right after which it is first reached)."""
    running, best, best_i = 0, -1, -1
    for i, e in enumerate(log.events):
        running += e.delta
        if running > best:
            best, best_i = running, i
    return best, best_i
