"""A model of torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.6), pure and deterministic.

What it models, each rule cited to the function of CUDACachingAllocator.cpp that holds it:

- round_size: every request is rounded up to a multiple of kMinBlockSize = 512 B (512 B at least).
- get_pool: a rounded request <= kSmallSize (1 MiB) is served from the small pool, else from the large pool.
- get_allocation_size: a new segment is kSmallBuffer (2 MiB) for small requests, kLargeBuffer (20 MiB) for
  requests below kMinLargeAlloc (10 MiB), else the request rounded up to kRoundLarge (2 MiB).
- get_free_block: best fit among the cached free blocks of the same pool and the same stream; the pool is a
  set ordered by (stream, size, address), so among equal sizes the lowest address wins. With max_split_size
  set, an oversize block (>= max_split_size) is not used for a smaller request, and an oversize request
  takes a cached block only if it is less than kLargeBuffer (20 MiB) bigger.
- should_split: a small-pool block is split when the remainder is >= 512 B; a large-pool block only when the
  request is below max_split_size and the remainder is > kSmallSize (1 MiB); otherwise the block keeps the
  leftover.
- free_block / try_merge_blocks: a freed block merges with the free neighbours of its segment.
- malloc: when cudaMalloc fails (the device capacity would be exceeded), release_available_cached_blocks
  (only with max_split_size set: free oversize cached blocks, the smallest sufficient one first) and then
  release_cached_blocks (every cached free block that is a whole segment) are tried, each followed by a
  retry, before the OOM is raised.
- release_cached_blocks / emptyCache: whole free segments are released, the large pool first, then the small
  pool, each in the pool's order (stream, size, address).

Not modelled (refused when asked for in the settings): expandable_segments, roundup_power2_divisions,
garbage_collection_threshold, and events that keep a freed block in use by another stream (the caller
frees a block when its free completes).

The model never invents addresses: a new segment's address comes from the caller (`segment_address`),
which in a replay of a snapshot is the address of the trace's segment_alloc and in a simulation a
deterministic counter.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Callable

from .files import InputError

KB, MB = 1 << 10, 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20 * MB  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MB  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MB  # kRoundLarge: round up large allocations to 2 MiB
SMALL, LARGE = "small", "large"

# every key torch's CUDAAllocatorConfig::parseArgs accepts (torch 2.6), modelled or not
_KNOWN_KEYS = {"max_split_size_mb", "expandable_segments", "roundup_power2_divisions",
               "garbage_collection_threshold", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
               "pinned_num_register_threads", "backend"}


class AllocatorConfigError(InputError):
    def __init__(self, message: str) -> None:
        super().__init__("alloc_conf", message)


class OutOfMemory(Exception):
    """cudaMalloc failed even after the cache was freed (torch's OutOfMemoryError)."""

    def __init__(self, requested: int, reserved: int, allocated: int, capacity: int) -> None:
        self.requested, self.reserved, self.allocated, self.capacity = requested, reserved, allocated, capacity
        super().__init__(f"Tried to allocate {requested} B with {reserved} B reserved ({allocated} B allocated) "
                         f"of a capacity of {capacity} B")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings, in PYTORCH_CUDA_ALLOC_CONF terms. max_split_size None = unlimited (torch's default)."""

    max_split_size: int | None = None
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """Parse torch's syntax, "key:value,key:value" (CUDAAllocatorConfig::parseArgs); refuse what is not modelled."""
        max_split: int | None = None
        expandable = False
        unmodelled = []
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key not in _KNOWN_KEYS:
                raise AllocatorConfigError(f"unknown allocator setting {key!r}; torch accepts "
                                           f"{', '.join(sorted(_KNOWN_KEYS))}")
            if not sep or not value:
                raise AllocatorConfigError(f"allocator setting {key!r} needs a value ({key}:VALUE)")
            if key == "max_split_size_mb":
                try:
                    mb = int(value)
                except ValueError:
                    raise AllocatorConfigError(f"max_split_size_mb must be an integer number of MiB, got {value!r}") from None
                # parseMaxSplitSize: values above 20 MiB only (kLargeBuffer / 1 MiB); larger than that is accepted
                if mb <= K_LARGE_BUFFER // MB:
                    raise AllocatorConfigError(f"max_split_size_mb must be > {K_LARGE_BUFFER // MB}, got {mb}")
                max_split = mb * MB
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise AllocatorConfigError(f"expandable_segments must be True or False, got {value!r}")
                expandable = value == "True"
                if expandable:
                    unmodelled.append("expandable_segments:True")
            elif key in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads"):
                continue  # no effect on the device allocator's block layout
            elif key == "backend":
                if value != "native":
                    unmodelled.append(f"backend:{value}")
            else:
                unmodelled.append(f"{key}:{value}")
        if unmodelled:
            raise AllocatorConfigError("allocator settings not modelled yet: " + ", ".join(unmodelled)
                                       + " (modelled: max_split_size_mb, expandable_segments:False)")
        return cls(max_split_size=max_split, expandable_segments=expandable)


def round_size(size: int) -> int:
    """round_size: up to a multiple of 512 B, at least 512 B (roundup_power2_divisions not modelled)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def pool_of(rounded: int) -> str:
    """get_pool: small if the rounded size is <= kSmallSize."""
    return SMALL if rounded <= K_SMALL_SIZE else LARGE


def allocation_size(rounded: int) -> int:
    """get_allocation_size: the size of a new segment for a request."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    segment: "Segment"
    allocated: bool = False
    requested: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


@dataclass(eq=False)
class Segment:
    addr: int
    size: int
    pool: str
    stream: int
    head: Block | None = None

    def blocks(self) -> list[Block]:
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out


@dataclass(frozen=True)
class SegmentEvent:
    kind: str  # "segment_alloc" | "segment_free"
    addr: int
    size: int
    stream: int


class CachingAllocator:
    """One device's allocator. `segment_address(size, stream) -> addr` gives the address of each new segment."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None,
                 segment_address: Callable[[int, int], int] | None = None) -> None:
        self.config = config or AllocatorConfig()
        if self.config.expandable_segments:
            raise AllocatorConfigError("expandable_segments:True is not modelled yet")
        self.capacity = capacity
        self._counter = 1 << 44
        self.segment_address = segment_address or self._next_address
        self.segments: dict[int, Segment] = {}
        self.blocks: dict[int, Block] = {}  # every block by address (allocated or free)
        self._free: dict[str, list[tuple[int, int, int]]] = {SMALL: [], LARGE: []}  # (stream, size, addr), sorted
        self.events: list[SegmentEvent] = []
        self.reserved = 0
        self.allocated = 0  # block bytes, torch's memory_allocated()
        self.requested = 0  # requested bytes
        self.ooms = 0

    def _next_address(self, size: int, stream: int) -> int:
        addr = self._counter
        self._counter += size
        return addr

    # --- the free-block index (the BlockPool's ordered set)
    def _index(self, b: Block) -> None:
        insort(self._free[b.segment.pool], (b.segment.stream, b.size, b.addr))

    def _unindex(self, b: Block) -> None:
        lst = self._free[b.segment.pool]
        i = bisect_left(lst, (b.segment.stream, b.size, b.addr))
        assert lst[i] == (b.segment.stream, b.size, b.addr)
        del lst[i]

    # --- state at record start (a replay)
    def add_segment(self, addr: int, size: int, stream: int, pool: str | None = None,
                    allocated: dict[int, tuple[int, int]] | None = None) -> Segment:
        """An existing segment with its allocated blocks {addr: (block size, requested)}; the gaps are free blocks."""
        seg = Segment(addr, size, pool or (SMALL if size <= K_SMALL_BUFFER else LARGE), stream)
        pos, prev = addr, None
        cuts = sorted((allocated or {}).items())
        pieces: list[tuple[int, int, bool, int]] = []
        for a, (bs, req) in cuts:
            if a < pos or a + bs > addr + size:
                raise ValueError(f"block {a:#x} (+{bs}) does not fit segment {addr:#x} (+{size}) after {pos:#x}")
            if a > pos:
                pieces.append((pos, a - pos, False, 0))
            pieces.append((a, bs, True, req))
            pos = a + bs
        if pos < addr + size:
            pieces.append((pos, addr + size - pos, False, 0))
        for a, bs, alloc, req in pieces:
            b = Block(a, bs, seg, alloc, req, prev)
            if prev is None:
                seg.head = b
            else:
                prev.next = b
            prev = b
            self.blocks[a] = b
            if alloc:
                self.allocated += bs
                self.requested += req
            else:
                self._index(b)
        self.segments[addr] = seg
        self.reserved += size
        return seg

    # --- malloc
    def _get_free_block(self, pool: str, stream: int, rounded: int) -> Block | None:
        lst = self._free[pool]
        i = bisect_left(lst, (stream, rounded, -1))
        if i == len(lst) or lst[i][0] != stream:
            return None
        size, addr = lst[i][1], lst[i][2]
        mss = self.config.max_split_size
        if mss is not None:
            if rounded < mss and size >= mss:
                return None  # do not return an oversize block for a small request
            if rounded >= mss and size >= rounded + K_LARGE_BUFFER:
                return None  # allow oversize blocks to be rounded up but only within a limit
        return self.blocks[addr]

    def _cuda_malloc(self, size: int, stream: int, pool: str) -> Block | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        addr = self.segment_address(size, stream)
        seg = Segment(addr, size, pool, stream)
        b = Block(addr, size, seg)
        seg.head = b
        self.segments[addr] = seg
        self.blocks[addr] = b
        self.reserved += size
        self.events.append(SegmentEvent("segment_alloc", addr, size, stream))
        return b

    def _release_segment(self, b: Block) -> None:
        seg = b.segment
        self._unindex(b)
        del self.blocks[b.addr]
        del self.segments[seg.addr]
        self.reserved -= seg.size
        self.events.append(SegmentEvent("segment_free", seg.addr, seg.size, seg.stream))

    def _release_available_cached_blocks(self, pool: str, stream: int, rounded: int) -> bool:
        """release_available_cached_blocks: only with max_split_size set. The key is max(request, max_split_size);
        the smallest cached block >= key on the stream is freed, else oversize blocks (>= max_split_size) from the
        largest down until key bytes are freed. (torch frees the found block even when it is part of a split
        segment, which cannot happen for oversize blocks; the model only frees whole segments.)"""
        mss = self.config.max_split_size
        if mss is None:
            return False
        key = max(rounded, mss)
        mine = [self.blocks[t[2]] for t in self._free[pool] if t[0] == stream]  # (size, addr) order
        whole = [b for b in mine if b.prev is None and b.next is None]
        fit = [b for b in whole if b.size >= key]
        if fit:
            self._release_segment(fit[0])
            return True
        released = 0
        for b in reversed([b for b in whole if b.size >= mss]):
            if released >= key:
                break
            released += b.size
            self._release_segment(b)
        return released >= key

    def release_cached_blocks(self) -> int:
        """release_cached_blocks / emptyCache: free every cached block that is a whole segment, large pool
        first, then small, each in (stream, size, address) order. Returns the bytes released."""
        before = self.reserved
        for pool in (LARGE, SMALL):
            for _, _, addr in list(self._free[pool]):
                b = self.blocks[addr]
                if b.prev is None and b.next is None:
                    self._release_segment(b)
        return before - self.reserved

    empty_cache = release_cached_blocks

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate `size` bytes on `stream`; returns the block's address (raises OutOfMemory)."""
        rounded = round_size(size)
        pool = pool_of(rounded)
        block = self._get_free_block(pool, stream, rounded)
        if block is not None:
            self._unindex(block)
        else:
            alloc_size = allocation_size(rounded)
            block = (self._cuda_malloc(alloc_size, stream, pool)
                     or (self._release_available_cached_blocks(pool, stream, rounded)
                         and self._cuda_malloc(alloc_size, stream, pool))
                     or (self.release_cached_blocks() >= 0 and self._cuda_malloc(alloc_size, stream, pool)))
            if not block:
                self.ooms += 1
                raise OutOfMemory(size, self.reserved, self.allocated, self.capacity or 0)
        remaining = block.size - rounded
        if self._should_split(pool, rounded, remaining):
            rest = Block(block.addr + rounded, remaining, block.segment, False, 0, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self.blocks[rest.addr] = rest
            self._index(rest)
        block.allocated = True
        block.requested = size
        self.allocated += block.size
        self.requested += size
        return block.addr

    def _should_split(self, pool: str, rounded: int, remaining: int) -> bool:
        if pool == SMALL:
            return remaining >= K_MIN_BLOCK_SIZE
        mss = self.config.max_split_size
        return (mss is None or rounded < mss) and remaining > K_SMALL_SIZE

    # --- free
    def free(self, addr: int) -> None:
        b = self.blocks.get(addr)
        if b is None or not b.allocated:
            raise KeyError(f"free of {addr:#x}, which is not an allocated block")
        b.allocated = False
        self.allocated -= b.size
        self.requested -= b.requested
        b.requested = 0
        for nb in (b.prev, b.next):  # try_merge_blocks with both neighbours
            if nb is not None and not nb.allocated:
                self._unindex(nb)
                del self.blocks[nb.addr]
                if nb is b.prev:
                    b.addr, b.prev = nb.addr, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = b
                    else:
                        b.segment.head = b
                else:
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                b.size += nb.size
        self.blocks.pop(addr, None)
        self.blocks[b.addr] = b
        self._index(b)

    # --- views
    def layout(self) -> dict[int, list[tuple[int, int, bool]]]:
        """{segment address: [(block address, size, allocated)]}: to compare with a snapshot's `segments`."""
        return {a: [(b.addr, b.size, b.allocated) for b in s.blocks()] for a, s in sorted(self.segments.items())}

    def largest_free(self) -> int:
        return max((t[1] for lst in self._free.values() for t in lst), default=0)
