"""What the engines (engine.py, simpy_engine.py) keep per memory pool: its live blocks and their total, with the
capacity whose first overrun is the OOM, its record (`oom_record`), and the exception that stops a run there."""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import Block, Category, Event, OOMRecord, Pool

PoolKey = tuple[int, Pool]  # (rank, pool)


class OutOfMemory(Exception):
    """Raised inside the engine to stop the run at the first OOM (when asked to stop)."""


@dataclass
class MemoryPool:
    """Live blocks of one (rank, pool) and their total; exact ints."""

    capacity: int | None = None
    live: dict[int, Block] = field(default_factory=dict)
    in_use: int = 0
    oom_seen: bool = False


def oom_record(pool: MemoryPool, event: Event) -> OOMRecord:
    """The first allocation over `pool`'s capacity, with the live set at that event: bytes by category and the
    ten largest blocks."""
    by_cat: dict[Category, int] = {}
    for b in pool.live.values():
        by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
    largest = tuple(sorted(pool.live.values(), key=lambda b: (-b.nbytes, b.id))[:10])
    return OOMRecord(event=event, capacity=pool.capacity, live_bytes=pool.in_use,
                     live_by_category=by_cat, largest_live=largest)
