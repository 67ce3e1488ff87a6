"""CachingAllocator: one device's allocator (DeviceCachingAllocator of c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Callable

from .blocks import Block, OutOfMemory, Segment, SegmentEvent
from .config import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    LARGE,
    SMALL,
    AllocatorConfig,
    AllocatorConfigError,
    allocation_size,
    pool_of,
    round_size,
)
from .expandable import ExpandableSegments


class CachingAllocator(ExpandableSegments):
    """One device's allocator. `segment_address(size, stream) -> addr` gives the address of each new segment (of an
    expandable segment: of its address space). `capacity`: the bytes the allocator may reserve (cudaMalloc and page
    mapping fail beyond it); with garbage_collection_threshold it is torch's allowed_memory_maximum, the device
    memory times the per-process memory fraction."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None,
                 segment_address: Callable[[int, int], int] | None = None) -> None:
        self.config = config or AllocatorConfig()
        # garbage_collect_cached_blocks runs only with set_fraction (allowed_memory_maximum); without one torch
        # ignores the threshold, so the model refuses it rather than silently do nothing
        self._gc = self.config.garbage_collection_threshold > 0
        self._plain_rounding = not self.config.roundup_power2_divisions  # (round_size then reads no config)
        if self._gc and capacity is None:
            raise AllocatorConfigError(
                "garbage_collection_threshold needs a capacity (the allowed bytes): torch applies it only under a "
                "per-process memory fraction (set_per_process_memory_fraction) and ignores it otherwise; give the "
                "device's bytes (peakledger: --budget; replay: --capacity)")
        self.capacity = capacity
        self._counter = 1 << 44
        self.segment_address = segment_address or self._next_address
        self.segments: dict[int, Segment] = {}
        self.blocks: dict[int, Block] = {}  # every block by address (allocated, free, pending or unmapped)
        self._free: dict[str, list[tuple[int, int, int]]] = {SMALL: [], LARGE: []}  # (stream, size, addr), sorted
        self._largest: int | None = 0  # `largest_free`, kept as blocks join the index; None: to find again
        self._unmapped: dict[str, list[tuple[int, int]]] = {SMALL: [], LARGE: []}  # (stream, addr), sorted
        self._events: dict[int, deque[list]] = {}  # stream -> [[block, done], ...]: insert_events' cuda_events
        self._gc_calls = {SMALL: 0, LARGE: 0}  # get_free_blocks_call_count per pool
        self.events: list[SegmentEvent] = []
        self.reserved = 0
        self.allocated = 0  # block bytes, torch's memory_allocated()
        self.requested = 0  # requested bytes of the blocks in use (allocated or waiting for their events)
        self.pending_free = 0  # bytes freed but kept until the streams that used them are done (record_stream)
        self.ooms = 0
        self.alloc_retries = 0  # torch's num_alloc_retries: requests served only after release_cached_blocks

    def _next_address(self, size: int, stream: int) -> int:
        addr = self._counter
        self._counter += size
        return addr

    # --- the free-block index (the BlockPool's set ordered by (stream, size, address)): insert_into_blocks
    def _index(self, b: Block) -> None:
        seg, size = b.segment, b.size
        b.gc_base = self._gc_calls[seg.pool]
        insort(self._free[seg.pool], (seg.stream, size, b.addr))
        if self._largest is not None and size > self._largest:
            self._largest = size

    def _unindex(self, b: Block) -> None:
        seg, size = b.segment, b.size
        lst = self._free[seg.pool]
        key = (seg.stream, size, b.addr)
        i = bisect_left(lst, key)
        assert lst[i] == key
        del lst[i]
        if self._largest is not None and size >= self._largest:  # (the largest may have left)
            self._largest = None

    def _try_merge(self, dst: Block, src: Block | None) -> None:
        # try_merge_blocks: a free neighbour with the same mapping state (and no outstanding event) joins dst
        if src is None or not src.free or src.mapped != dst.mapped:
            return
        (self._unindex if src.mapped else self._unindex_unmapped)(src)
        del self.blocks[src.addr]
        if src is dst.prev:
            del self.blocks[dst.addr]
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
            else:
                dst.segment.head = dst
            self.blocks[dst.addr] = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # --- state at record start (a replay)
    def add_segment(self, addr: int, size: int, stream: int, pool: str | None = None,
                    allocated: dict[int, tuple[int, int]] | None = None) -> Segment:
        """An existing segment with its allocated blocks {addr: (block size, requested)}; the gaps are free blocks."""
        seg = Segment(addr, size, pool or (SMALL if size <= K_SMALL_BUFFER else LARGE), stream)
        pos, prev = addr, None
        pieces: list[tuple[int, int, bool, int]] = []
        for a, (bs, req) in sorted((allocated or {}).items()):
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
        # get_free_block: best fit on the stream, lowest address among equal sizes
        if self._gc:
            self._gc_calls[pool] += 1  # block ages count get_free_block calls, only when gc is on
        lst = self._free[pool]
        i = bisect_left(lst, (stream, rounded, -1))
        if i == len(lst) or lst[i][0] != stream:
            return None
        if self.config.expandable_segments and self.blocks[lst[i][2]].segment.expandable:
            # get_free_block: an expandable block counts as its size plus the unmapped range after it; a later (bigger)
            # block of smaller such size is preferred
            def grow(j: int) -> int:
                b = self.blocks[lst[j][2]]
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while (self.blocks[lst[i][2]].segment.expandable and i + 1 < len(lst) and lst[i + 1][0] == stream
                   and grow(i + 1) < grow(i)):
                i += 1
        size, addr = lst[i][1], lst[i][2]
        mss = self.config.max_split_size
        if mss is not None:
            if rounded < mss and size >= mss:
                return None  # get_free_block: do not return an oversize block for a small request
            if rounded >= mss and size >= rounded + self.config.max_non_split_rounding:
                return None  # get_free_block: oversize blocks rounded up only within max_non_split_rounding_size
        b = self.blocks[addr]
        self._unindex(b)
        return b

    def _cuda_malloc(self, size: int, stream: int, pool: str) -> Block | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        addr = self.segment_address(size, stream)
        seg = Segment(addr, size, pool, stream)
        b = seg.head = Block(addr, size, seg)
        self.segments[addr] = seg
        self.blocks[addr] = b
        self.reserved += size
        self.events.append(SegmentEvent("segment_alloc", addr, size, stream))
        return b

    def _alloc_block(self, pool: str, stream: int, rounded: int, alloc_size: int) -> Block | None:
        # alloc_block: with a memory fraction set, fail when reserved + the allocation size passes the allowed bytes
        # (also for expandable segments); then map pages (expandable) or cudaMalloc a segment
        if self._gc and self.reserved + alloc_size > self.capacity:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, rounded)
        return self._cuda_malloc(alloc_size, stream, pool)

    def _release_segment(self, b: Block) -> None:
        # release_block: cudaFree of a whole cached segment
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
        whole = [b for b in (self.blocks[t[2]] for t in self._free[pool] if t[0] == stream)
                 if b.prev is None and b.next is None]
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

    def _garbage_collect(self) -> None:
        # garbage_collect_cached_blocks: above threshold * allowed bytes, free whole cached large-pool segments whose
        # age (get_free_block calls since cached) is >= the average age, pass after pass, until the excess is freed
        limit = int(self.config.garbage_collection_threshold * self.capacity)
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        age = lambda b: self._gc_calls[LARGE] - b.gc_base  # noqa: E731 - Block::gc_count
        whole = lambda b: b.prev is None and b.next is None and not b.segment.expandable  # noqa: E731 - !is_split()
        freeable = [b for b in (self.blocks[t[2]] for t in self._free[LARGE]) if whole(b)]
        total, count = sum(age(b) for b in freeable), len(freeable)
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold, freed = total / count, False
            for b in [self.blocks[t[2]] for t in self._free[LARGE]]:
                if whole(b) and age(b) >= threshold:
                    freed = True
                    reclaimed += b.size
                    total -= age(b)
                    count -= 1
                    self._release_segment(b)

    def release_cached_blocks(self) -> int:
        """release_cached_blocks / emptyCache: first every outstanding stream event is waited for (their blocks are
        freed), then per pool, large then small, in (stream, size, address) order, every cached block that is a whole
        segment is cudaFreed and the whole pages of every cached block of an expandable segment are unmapped
        (release_blocks). Returns the bytes released."""
        before = self.reserved
        self._synchronize_and_free_events()
        for pool in (LARGE, SMALL):
            to_unmap = []
            for _, _, addr in list(self._free[pool]):
                b = self.blocks[addr]
                if b.segment.expandable:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_segment(b)
            for b in to_unmap:
                self._unmap_block(b)
                if not b.mapped and b.prev is None and b.next is None:
                    self._release_expandable_segment(b)
        return before - self.reserved

    empty_cache = release_cached_blocks

    def _split_after(self, block: Block, size: int, mapped: bool = True) -> Block:
        """Cut `block` to `size` bytes; the rest of it becomes the next block of its segment (registered, not
        indexed: the caller files it as cached or unmapped) and is returned."""
        rest = Block(block.addr + size, block.size - size, block.segment, mapped=mapped, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self.blocks[rest.addr] = rest
        return rest

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate `size` bytes on `stream`; returns the block's address (raises OutOfMemory)."""
        if self._events:
            self.process_events()
        rounded = round_size(size, None if self._plain_rounding else self.config)  # (None: no divisions to read)
        pool = pool_of(rounded)
        block = self._get_free_block(pool, stream, rounded)
        if block is None:
            if self._gc:
                self._garbage_collect()
            alloc_size = allocation_size(rounded)
            block = (self._alloc_block(pool, stream, rounded, alloc_size)
                     or (self._release_available_cached_blocks(pool, stream, rounded)
                         and self._alloc_block(pool, stream, rounded, alloc_size))
                     or self._retry(pool, stream, rounded, alloc_size))
            if not block:
                self.ooms += 1
                raise OutOfMemory(size, self.reserved, self.allocated, self.capacity or 0)
        remaining = block.size - rounded
        if self._should_split(pool, rounded, remaining):  # alloc_found_block: the rest stays cached
            self._index(self._split_after(block, rounded))
        block.allocated = True
        block.requested = size
        self.allocated += block.size
        self.requested += size
        return block.addr

    def _retry(self, pool: str, stream: int, rounded: int, alloc_size: int):
        """The last resort: every cached block released, then alloc_block again (CUDACachingAllocator.cpp malloc,
        torch 2.6-2.13: alloc_block(isRetry=true) counts num_alloc_retries before it tries)."""
        self.release_cached_blocks()
        self.alloc_retries += 1
        return self._alloc_block(pool, stream, rounded, alloc_size)

    def _should_split(self, pool: str, rounded: int, remaining: int) -> bool:
        # should_split: small pool, or any pool with expandable segments on: a remainder >= 512 B; large pool: only
        # below max_split_size and for a remainder > kSmallSize
        if pool == SMALL or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        mss = self.config.max_split_size
        return (mss is None or rounded < mss) and remaining > K_SMALL_SIZE

    # --- free, and blocks used on other streams
    def record_stream(self, addr: int, stream: int) -> None:
        """recordStream: the allocated block is also used on `stream` (its own stream is ignored); its free then
        waits for the work queued on `stream` so far."""
        b = self.blocks.get(addr)
        if b is None or not b.allocated:
            raise KeyError(f"record_stream of {addr:#x}, which is not an allocated block")
        if stream != b.segment.stream:
            if b.stream_uses is None:
                b.stream_uses = set()
            b.stream_uses.add(stream)

    def free(self, addr: int) -> None:
        """free: allocated bytes drop at once; a block used on other streams (record_stream) is kept, with an event
        recorded on each of those streams (insert_events), until they are done (synchronize / process_events)."""
        b = self.blocks.get(addr)
        if b is None or not b.allocated:
            raise KeyError(f"free of {addr:#x}, which is not an allocated block")
        b.allocated = False
        self.allocated -= b.size
        if b.stream_uses:
            for s in sorted(b.stream_uses):
                self._events.setdefault(s, deque()).append([b, False])
                b.event_count += 1
            b.stream_uses.clear()
            self.pending_free += b.size
        else:
            self._free_block(b)

    def _free_block(self, b: Block) -> None:
        # free_block: the block merges with its free neighbours and is cached
        self.requested -= b.requested
        b.requested = 0
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._index(b)

    def _event_done(self, b: Block) -> None:
        b.event_count -= 1
        if b.event_count == 0:
            self.pending_free -= b.size
            self._free_block(b)

    def synchronize(self, stream: int | None = None) -> None:
        """The work queued on `stream` (every stream: None) is done: its events complete, and their blocks are freed
        (as torch's next process_events does)."""
        for s in ([stream] if stream is not None else list(self._events)):
            for entry in self._events.get(s, ()):
                entry[1] = True
        self.process_events()

    def process_events(self) -> None:
        """process_events (run by malloc first): per stream (in stream order), completed events in the order
        recorded; a block whose last event completes is freed. An event completes only by `synchronize`."""
        for s in sorted(self._events):
            q = self._events[s]
            while q and q[0][1]:
                self._event_done(q.popleft()[0])
            if not q:
                del self._events[s]

    def _synchronize_and_free_events(self) -> None:
        # synchronize_and_free_events (release_cached_blocks): every outstanding event is waited for
        for s in sorted(self._events):
            for b, _ in self._events[s]:
                self._event_done(b)
        self._events.clear()

    # --- views
    def layout(self) -> dict[int, list[tuple[int, int, bool]]]:
        """{segment address: [(block address, size, in use)]}: to compare with a snapshot's `segments` (in use:
        allocated, or freed and waiting for another stream); an expandable segment shows one entry per mapped range."""
        out: dict[int, list[tuple[int, int, bool]]] = {}
        for a, s in self.segments.items():
            if s.expandable:
                out.update(self._mapped_ranges(s))
            else:
                out[a] = [(b.addr, b.size, not b.free) for b in s.blocks()]
        return dict(sorted(out.items()))

    def close(self) -> None:
        """Done with the allocator: its blocks' links (prev / next, their segment, each segment's head) and its own
        address function (a bound method of it) are cut, so what it made is freed by reference counting, not left
        in reference cycles for the cyclic collector. Its counters stay readable; it serves no more requests."""
        for b in self.blocks.values():
            b.prev = b.next = b.segment = None
        for seg in self.segments.values():
            seg.head = None
        self.segment_address = None
        self._events.clear()

    def largest_free(self) -> int:
        """The largest cached free block: each pool's index is ordered by (stream, size, address), so each
        stream's largest is the last entry before the next stream's first. Kept between calls: a block joining the
        index raises it, and only the removal of a block as large as it makes it be found again."""
        if self._largest is not None:
            return self._largest
        best = 0
        for lst in self._free.values():
            i = len(lst)
            while i:
                stream, size, _ = lst[i - 1]
                best = max(best, size)
                i = bisect_left(lst, (stream, -1, -1), 0, i - 1)
        self._largest = best
        return best
