"""The state at record start: the segments and blocks live when the recording began, rebuilt from the final
`segments` by undoing the trace backwards, as torch's MemoryViz does (`start_state`); where the walk back does not
fit, the trace is truncated (its problems say where)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field

from ...simulator.allocator import K_SMALL_SIZE, LARGE, SMALL, round_size

LIVE_STATES = ("active_allocated", "active_pending_free")  # a block the user has not yet got back


@dataclass
class StartState:
    """The state at record start, rebuilt from the final `segments` by undoing the trace backwards (as torch's
    MemoryViz does: torch/utils/viz/MemoryViz.js `simulate_memory`): segments {addr: (size, stream, pool)} and
    blocks {addr: (block size, requested size)}. `problems` are (kind, message) where the walk back does not fit;
    kind "unplaced" is a free of a block that lies in no segment at that time."""

    segments: dict[int, tuple[int, int, str]]
    blocks: dict[int, tuple[int, int]]
    problems: list[tuple[str, str]] = field(default_factory=list)


def final_state(snapshot: dict, device: int = 0) -> tuple[dict, dict]:
    """The segments and live blocks of `device` at dump time (a pending free is still live to the user)."""
    segs, blocks = {}, {}
    for s in snapshot["segments"]:
        if s.get("device", 0) != device:
            continue
        segs[s["address"]] = (s["total_size"], s.get("stream", 0), SMALL if s.get("segment_type") == "small" else LARGE)
        for b in s.get("blocks", []):
            if b.get("state") in LIVE_STATES:
                blocks[b["address"]] = (b["size"], b.get("requested_size", b["size"]))
    return segs, blocks


def start_state(snapshot: dict, entries: list[dict], device: int = 0) -> StartState:
    """Undo `entries` (one device's trace, checked by check_shape) from the final state. An alloc undone removes
    its block, a free_completed undone puts it back (its rounded size; in the large pool it also takes a following
    free gap of 1 MiB or less: such a gap can only be the leftover the block kept, as should_split never leaves a
    large free block of <= 1 MiB); a segment_alloc / segment_map undone removes the range, a segment_free /
    segment_unmap undone puts it back. Whatever does not fit is a problem, and the walk goes on."""
    segs, blocks = final_state(snapshot, device)
    saddrs, baddrs = sorted(segs), sorted(blocks)
    sure = {a: size for a, (size, _) in blocks.items()}  # bytes each block surely spans (no leftover guessed)
    problems: list[tuple[str, str]] = []

    def seg_at(addr: int):
        k = bisect_right(saddrs, addr) - 1
        return saddrs[k] if k >= 0 and addr < saddrs[k] + segs[saddrs[k]][0] else None

    def overlaps(addr: int, size: int) -> bool:
        k = bisect_right(saddrs, addr) - 1
        if k >= 0 and saddrs[k] + segs[saddrs[k]][0] > addr:
            return True
        k = bisect_left(saddrs, addr)
        return k < len(saddrs) and saddrs[k] < addr + max(size, 1)

    def blocks_in(addr: int, size: int) -> bool:
        k = bisect_left(baddrs, addr)
        return k < len(baddrs) and baddrs[k] < addr + size

    def put_segment(addr: int, size: int, stream: int, merge: bool) -> None:
        """Put a range back; an unmapped one joins the mapped ranges beside it (MemoryViz.js map_segment)."""
        pool = SMALL if size <= 2 * K_SMALL_SIZE else LARGE
        k = bisect_left(saddrs, addr)
        if merge and k < len(saddrs) and saddrs[k] == addr + size and segs[saddrs[k]][1] == stream:
            size += segs.pop(saddrs.pop(k))[0]
        if merge and k > 0 and saddrs[k - 1] + segs[saddrs[k - 1]][0] == addr and segs[saddrs[k - 1]][1] == stream:
            addr = saddrs[k - 1]
            size += segs[addr][0]
        if addr not in segs:
            insort(saddrs, addr)
        segs[addr] = (size, stream, pool if not merge or addr not in segs else segs[addr][2])

    def cut(addr: int, size: int) -> int:
        """Remove [addr, addr + size) from the segments (a segment_map undone); the bytes it covered."""
        covered, end = 0, addr + size
        k = max(bisect_right(saddrs, addr) - 1, 0)
        pieces = []
        for a in [a for a in saddrs[k:bisect_left(saddrs, end)] if a + segs[a][0] > addr]:
            sz, stream, pool = segs.pop(a)
            saddrs.remove(a)
            lo, hi = max(a, addr), min(a + sz, end)
            covered += hi - lo
            pieces += [(start, n, stream, pool) for start, n in ((a, lo - a), (hi, a + sz - hi)) if n > 0]
        for start, n, stream, pool in pieces:
            if start not in segs:
                insort(saddrs, start)
            segs[start] = (n, stream, pool)
        return covered

    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        action, addr, size = e["action"], e.get("addr"), e.get("size", 0)
        if action == "alloc":
            sure.pop(addr, None)
            if blocks.pop(addr, None) is None:
                problems.append(("alloc", f"entry {i}: alloc at {addr:#x} ({size} B), but no block is live there "
                                          "after it (allocated again before a free, "
                                          "or missing from the final segments)"))
            else:
                baddrs.remove(addr)
        elif action == "free_completed":
            seg = seg_at(addr)
            if seg is None:
                problems.append(("unplaced", f"entry {i}: free_completed of {addr:#x} lies in no segment at that time"))
                continue
            if addr in blocks:
                problems.append(("free", f"entry {i}: free_completed of {addr:#x}, which is live again after it "
                                         "with no alloc between (freed twice?)"))
            bs = round_size(size)
            seg_size, _, pool = segs[seg]
            end = seg + seg_size
            k = bisect_right(baddrs, addr)
            nxt = baddrs[k] if k < len(baddrs) and baddrs[k] < end else end
            if pool == LARGE and 0 < nxt - (addr + bs) <= K_SMALL_SIZE:
                bs = nxt - addr  # the leftover the block kept (should_split: not split off)
            prev = baddrs[k - 1] if k > 0 and baddrs[k - 1] != addr else (baddrs[k - 2] if k > 1 else None)
            if nxt < addr + round_size(size) or (prev is not None and prev >= seg and prev + sure[prev] > addr):
                problems.append(("free", f"entry {i}: free_completed of {addr:#x} ({size} B) overlaps a block "
                                         "live at that time"))
            if addr not in blocks:
                insort(baddrs, addr)
            blocks[addr] = (bs, size)
            sure[addr] = round_size(size)
        elif action == "segment_alloc":
            if addr not in segs or segs[addr][0] != size:
                problems.append(("segment", f"entry {i}: segment_alloc of {addr:#x} ({size} B), but no such segment "
                                            "is reserved after it"))
            elif blocks_in(addr, size):
                problems.append(("segment", f"entry {i}: segment_alloc of {addr:#x}, but blocks inside it are "
                                            "live before it"))
            if segs.pop(addr, None) is not None:
                saddrs.remove(addr)
        elif action == "segment_map":
            if cut(addr, size) != size:
                problems.append(("segment", f"entry {i}: segment_map of {addr:#x} ({size} B), but that range is "
                                            "not mapped after it"))
        elif action in ("segment_free", "segment_unmap"):
            if overlaps(addr, size):
                problems.append(("segment", f"entry {i}: {action} of {addr:#x} ({size} B), but that range is "
                                            "reserved again after it with no segment_alloc between"))
            put_segment(addr, size, e.get("stream", 0), action == "segment_unmap")
    return StartState(segs, blocks, problems)
