"""Expandable segments (expandable_segments:True): one segment per (stream, pool) reserving address space and mapping
physical pages as requests need them; see Note [Expandable Segments] in c10/cuda/CUDACachingAllocator.cpp.

Pages are kSmallBuffer (2 MiB) in the small pool and kLargeBuffer (20 MiB) in the large pool (find_expandable_block).
Reserved memory is the mapped pages. A freed block stays mapped; release_cached_blocks (empty_cache, and the retry
after a failed mapping) unmaps the whole pages inside each free block (unmap_block), and drops a segment whose
address space is all unmapped again (release_expandable_segment). Mixed into CachingAllocator (core.py), whose
block index and merge rules it shares.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from .blocks import Block, Segment, SegmentEvent
from .config import K_LARGE_BUFFER, K_SMALL_BUFFER, SMALL

DEFAULT_DEVICE_MEMORY = 1 << 40  # the device size behind the address space when no capacity is given


class ExpandableSegments:
    """The expandable-segment half of CachingAllocator: self.blocks, self.segments, self._free, self._unmapped,
    self.reserved, self.capacity, self.events, self._index/_unindex/_try_merge come from core.py."""

    # --- the pool's `unmapped` set, ordered by (stream, address) (BlockComparatorAddress)
    def _index_unmapped(self, b: Block) -> None:
        insort(self._unmapped[b.segment.pool], (b.segment.stream, b.addr))

    def _unindex_unmapped(self, b: Block) -> None:
        lst = self._unmapped[b.segment.pool]
        i = bisect_left(lst, (b.segment.stream, b.addr))
        assert lst[i] == (b.segment.stream, b.addr)
        del lst[i]

    def _new_expandable_segment(self, pool: str, stream: int) -> Block:
        # find_expandable_block / ExpandableSegment: address space for 1 1/8 of the device's memory, in whole pages
        page = K_SMALL_BUFFER if pool == SMALL else K_LARGE_BUFFER
        total = self.capacity if self.capacity is not None else DEFAULT_DEVICE_MEMORY
        size = page * -(-(total + total // 8) // page)
        seg = Segment(self.segment_address(size, stream), size, pool, stream, page=page)
        b = seg.head = Block(seg.addr, size, seg, mapped=False)
        self.segments[seg.addr] = seg
        self.blocks[b.addr] = b
        self._index_unmapped(b)
        return b

    def _find_expandable_block(self, pool: str, stream: int, size: int) -> Block:
        # find_expandable_block: the lowest unmapped range of the stream's segments (joined with a free block just
        # before it) with `size` bytes of free or unmapped address space from there on; else a new segment
        lst = self._unmapped[pool]
        i = bisect_left(lst, (stream, -1))
        while i < len(lst) and lst[i][0] == stream:
            c = self.blocks[lst[i][1]]
            if c.prev is not None and c.prev.free:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and b.free:  # has_available_address_space
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        return self._new_expandable_segment(pool, stream)

    def _map_block(self, to_map: Block, size: int) -> bool:
        # map_block / ExpandableSegment::map: the pages covering [to_map, +size) are mapped (all or none: a failed
        # cuMemCreate releases this call's pages); the unmapped rest is split off; the block merges with free mapped
        # neighbours and is cached
        seg, page = to_map.segment, to_map.segment.page
        offset = to_map.addr - seg.addr
        nbytes = (-(-(offset + size) // page) - offset // page) * page
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self._unindex_unmapped(to_map)
        to_map.mapped = True
        if nbytes < to_map.size:
            self._index_unmapped(self._split_after(to_map, nbytes, mapped=False))
        self.events.append(SegmentEvent("segment_map", to_map.addr, nbytes, seg.stream))
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._index(to_map)
        self.reserved += nbytes
        return True

    def _try_allocate_expandable_block(self, pool: str, stream: int, size: int) -> Block | None:
        # try_allocate_expandable_block: map from the candidate on until one free block holds `size` (pages mapped
        # before a failed mapping stay mapped); the block leaves the cache
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next  # unmapped: a free mapped neighbour would have been merged
            # (none: a new segment's address space, 1 1/8 of a capacity below one request, cannot hold it: an OOM)
            if nxt is None or not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        self._unindex(c)
        return c

    def _unmap_block(self, b: Block) -> None:
        # unmap_block / ExpandableSegment::unmap: the whole pages inside the free block are unmapped; the partial
        # pages before and after stay mapped as free blocks; the unmapped range merges with unmapped neighbours
        seg, page = b.segment, b.segment.page
        offset = b.addr - seg.addr
        first, last = -(-offset // page), (offset + b.size) // page
        if first >= last:
            return
        start, nbytes = seg.addr + first * page, (last - first) * page
        self._unindex(b)
        del self.blocks[b.addr]
        before, after = start - b.addr, b.addr + b.size - (start + nbytes)
        if before > 0:
            bf = Block(b.addr, before, seg, prev=b.prev, next=b)
            if b.prev is not None:
                b.prev.next = bf
            else:
                seg.head = bf
            b.prev = bf
            self.blocks[bf.addr] = bf
            self._index(bf)
        b.addr, b.size = start, nbytes + after  # the pages to unmap, then the mapped rest after them
        if after > 0:
            self._index(self._split_after(b, nbytes))
        b.mapped = False
        self.blocks[start] = b
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._index_unmapped(b)
        self.reserved -= nbytes
        self.events.append(SegmentEvent("segment_unmap", start, nbytes, seg.stream))

    def _release_expandable_segment(self, b: Block) -> None:
        # release_expandable_segment: an all-unmapped segment gives its address space back (no trace event)
        self._unindex_unmapped(b)
        del self.blocks[b.addr]
        del self.segments[b.segment.addr]

    def _mapped_ranges(self, seg: Segment) -> dict[int, list[tuple[int, int, bool]]]:
        # snapshot(): an expandable segment shows as one segment per contiguous mapped range
        out: dict[int, list[tuple[int, int, bool]]] = {}
        start = None
        for b in seg.blocks():
            if not b.mapped:
                start = None
                continue
            if start is None:
                start = b.addr
                out[start] = []
            out[start].append((b.addr, b.size, not b.free))
        return out
