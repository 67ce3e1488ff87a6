"""The allocator's bookkeeping: blocks linked inside their segment, segments, and the events a trace records."""

from __future__ import annotations

from dataclasses import dataclass


class OutOfMemory(Exception):
    """cudaMalloc (or the page mapping) failed even after the cache was freed (torch's OutOfMemoryError)."""

    def __init__(self, requested: int, reserved: int, allocated: int, capacity: int) -> None:
        self.requested, self.reserved, self.allocated, self.capacity = requested, reserved, allocated, capacity
        super().__init__(f"Tried to allocate {requested} B with {reserved} B reserved ({allocated} B allocated) "
                         f"of a capacity of {capacity} B")


@dataclass(eq=False, slots=True)
class Block:
    """torch's Block: a piece of a segment. Free (cached) when not allocated and no stream event is outstanding;
    `mapped` is False only for the unmapped address space of an expandable segment."""

    addr: int
    size: int
    segment: "Segment"
    allocated: bool = False
    requested: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None
    mapped: bool = True
    event_count: int = 0  # outstanding events of other streams that used it (freed, not reusable yet)
    stream_uses: set[int] | None = None  # recordStream: other streams using the allocated block (None: none yet)
    gc_base: int = 0  # gc_count_base: the pool's get_free_block count when the block was cached

    @property
    def free(self) -> bool:
        """Reusable: not allocated and no outstanding event (torch's `allocatable` / try_merge_blocks test)."""
        return not self.allocated and self.event_count == 0


@dataclass(eq=False, slots=True)
class Segment:
    """A cudaMalloc'd segment, or an expandable segment's reserved address space (`page` > 0: the mapping unit)."""

    addr: int
    size: int
    pool: str
    stream: int
    head: Block | None = None
    page: int = 0

    @property
    def expandable(self) -> bool:
        return self.page > 0

    def blocks(self) -> list[Block]:
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out


@dataclass(frozen=True)
class SegmentEvent:
    kind: str  # "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" (expandable segments)
    addr: int
    size: int
    stream: int
