"""What the engines (engine.py, simpy_engine.py) keep per memory pool: its live blocks and their total, with the
capacity whose first overrun is the OOM, and the exception that stops a run there."""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import Block, Pool

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
