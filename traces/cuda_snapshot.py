"""CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`) into the event schema, safely.

A snapshot pickle holds `segments` (what cudaMalloc reserved, with the blocks inside at dump time) and
`device_traces` (per device: alloc / free_requested / free_completed / segment_alloc / segment_free /
segment_map / segment_unmap / oom / snapshot entries with addr, size, stream, time_us, frames). Two views,
each an EventLog: allocated (one Block per `alloc`, its requested bytes, freed at `free_completed`: only then
may the allocator hand the memory back) and reserved (one Block per `segment_alloc` / `segment_map`, freed at
`segment_free` / `segment_unmap`). Every device is read (`parse_snapshot_devices`); every stream is kept (a
non-default stream's events say it in their op, `alloc (stream 1)`, numbered as MemoryViz does).

Recording usually starts mid-run (parameters allocated before it, a cache released inside it). The state at
record start is rebuilt from the final `segments` by undoing the trace backwards, as torch's MemoryViz does
(`start_state`), and both views open with it as allocations (category unknown, op and name `pre-existing`).
A free of a block the trace never allocated is such state, not a lost head.

A trace is `truncated` (the ring buffer wrapped, or the file does not hang together) when it holds as many
entries as a `max_entries` the file records, or when the walk back does not fit: a free of a block in no
segment or on top of a live block, an alloc whose block is not live after it, a segment released while
reserved or allocated with blocks in it. Its peak is refused (`TruncatedTraceError`) unless asked for as a
lower bound. A buffer that wrapped at a consistent point with no `max_entries` recorded (torch 2.6 writes
none) cannot be told from a recording started there.

Pickles can run code when loaded: `safe_loads` admits no global at all (a snapshot is plain data) and refuses
a pickle that names a class or function with `UnsafePickleError` naming it.
"""

from __future__ import annotations

import heapq
import io
import pickle
import re
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..simulator.allocator import K_SMALL_SIZE, LARGE, SMALL, round_size
from ..simulator.events import Action, Block, Category, Event, EventLog, OOMRecord, Phase, Pool, Stream
from ..simulator.run_metadata import RunMetadata
from ..simulator.safe_io import InputError, read_input

TRACE_FILE_LIMIT = 512 << 20  # bytes of any trace file (a snapshot, a JSON trace, a gzip'd one unpacked)
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset()
KNOWN_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "oom", "snapshot"}
PREEXISTING_OP = "pre-existing"  # the op of the events that open a log with the state at record start
LIVE_STATES = ("active_allocated", "active_pending_free")  # a block the user has not yet got back
CATEGORY_NAMES = {c.value: c for c in Category} | {
    # torch.profiler._memory_profiler.Category names, as _profile_to_snapshot writes them
    "parameter": Category.PARAMETER, "optimizer_state": Category.OPTIMIZER_STATE, "gradient": Category.GRADIENT,
    "activation": Category.ACTIVATION, "temporary": Category.TEMPORARY, "input": Category.INPUT,
    "autograd_detail": Category.TEMPORARY, "unknown": Category.UNKNOWN}


class SnapshotError(InputError):
    """The file is not a snapshot we can read; the message says why."""

    def __init__(self, message: str, field_name: str = "trace") -> None:
        super().__init__(field_name, message)


class UnsafePickleError(SnapshotError):
    pass


class TruncatedTraceError(SnapshotError):
    pass


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(f"refusing to load {module}.{name}: a memory snapshot holds only plain data "
                                "(dicts, lists, strings, numbers); this pickle would import code")


def safe_loads(data: bytes, field_name: str = "trace"):
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(e.message, field_name) from None
    except Exception as e:  # truncated files, garbage, too deep: say so instead of a traceback
        raise SnapshotError(f"not a readable pickle: {type(e).__name__}: {e}", field_name) from None


@dataclass
class SnapshotTrace:
    device: int
    allocated: EventLog
    reserved: EventLog
    truncated: bool = False
    problems: list[str] = field(default_factory=list)
    preexisting: int = 0  # blocks live at record start (allocated before the recording began)
    preexisting_bytes: int = 0  # their requested bytes
    preexisting_segments: int = 0  # segments reserved at record start
    preexisting_reserved: int = 0  # their bytes

    @property
    def block_problems(self) -> list[str]:
        """Why the trace is truncated (the walk back is joint, so these concern both views)."""
        return list(self.problems)

    def peak_bytes(self, allow_truncated: bool = False) -> int:
        if self.truncated and not allow_truncated:
            raise TruncatedTraceError("the trace is truncated (" + "; ".join(self.problems[:3]) + "): its peak would "
                                      "be wrong. Record with a larger max_entries, or ask for a lower bound.")
        return _peak(self.allocated)

    def reserved_peak_bytes(self, allow_truncated: bool = False) -> int:
        if self.truncated and not allow_truncated:
            self.peak_bytes()
        return _peak(self.reserved)


def _peak(log: EventLog) -> int:
    best = running = 0
    for e in log.events:
        running += e.delta
        best = max(best, running)
    return best


def _python_frames(frames) -> list[dict]:
    return [f for f in frames or () if str(f.get("filename", "")).endswith(".py")]


_BACKWARD_NODE = re.compile(r"(\w+Backward\d*)::apply")
_ATEN_OP = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)")


def _backward_node(frames) -> str | None:
    """The autograd node a C++ stack runs in (`MulBackward0`), if any."""
    for f in frames or ():
        name = str(f.get("name", ""))
        if "Backward" in name and "::apply" in name:
            m = _BACKWARD_NODE.search(name)
            if m:
                return m.group(1)
    return None


def _phase_of(frames: list[dict]) -> Phase:
    """A snapshot knows no phases; guess from the stack (documented heuristic): an optimizer's Python frame, a
    Python `backward`, or autograd's engine (backward runs on its own thread, with no Python frame)."""
    py = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in _python_frames(frames))
    if "torch/optim" in py or "optimizer" in py.lower():
        return Phase.OPTIMIZER
    if "backward" in py:
        return Phase.BACKWARD
    if not py and (_backward_node(frames) or any("autograd::Engine" in str(f.get("name", "")) for f in frames or ())):
        return Phase.BACKWARD
    return Phase.FORWARD


def _frame_name(frames: list[dict]) -> str:
    """The innermost user Python frame (file:line:function, as torch's _memory_viz writes it), else the first
    Python frame, else the autograd node (`MulBackward0`), else the aten op (`aten::clone`), else the first
    named frame with a file."""
    py = _python_frames(frames)
    user = [f for f in py if "site-packages" not in str(f["filename"]) and "/torch/" not in str(f["filename"])]
    for f in user[:1] or py[:1]:
        return f"{str(f['filename']).rsplit('/', 1)[-1]}:{f.get('line', 0)}:{f.get('name', '')}"
    node = _backward_node(frames)
    if node:
        return node
    names = [str(f.get("name", "")) for f in frames or ()]
    op = next((m.group(1) for n in names if "at::_ops::" in n and (m := _ATEN_OP.search(n))), None)
    if op:  # a C++-only stack (autograd's engine thread): the aten op that allocated
        return ("autograd engine: " if any("autograd::Engine" in n for n in names) else "") + f"aten::{op}"
    for f in frames or ():
        name = str(f.get("name", ""))
        if name and not str(f.get("filename", "")).startswith("??"):
            return f"{f.get('filename', '')}:{f.get('line', 0)}:{name}"
    return "?"


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _show(x) -> str:
    """`x` in a message, at a bounded cost: a container or an object is named by its type (its repr could be
    exponential: a pickle's memo can share one tuple at every level of a deep nest), a long number by its size."""
    if isinstance(x, str):
        text = repr(x[:40])
    elif isinstance(x, bool) or x is None or isinstance(x, float):
        text = repr(x)
    elif isinstance(x, int):
        text = repr(x) if abs(x) < 10 ** 30 else f"an integer of {x.bit_length()} bits"
    else:
        text = f"a {type(x).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _frame(f) -> bool:
    """A stack frame as torch writes it: the values read are strings and a line number (types checked before a
    value is turned into text: str() of a nest the pickle's memo shares at every level takes exponential time)."""
    return isinstance(f, dict) and isinstance(f.get("name", ""), str) and isinstance(f.get("filename", ""), str) \
        and _int(f.get("line", 0))


def _u64(x) -> bool:
    """An address or a size as torch writes them (64-bit, >= 0)."""
    return _int(x) and 0 <= x < 1 << 64


def check_shape(snapshot, device: int, field_name: str) -> list[dict]:
    """The parts of a snapshot this reader uses, with the types torch writes them in; else SnapshotError
    naming the first entry that is not (torch/cuda/memory.py `_snapshot`, c10/cuda/CUDACachingAllocator.h)."""
    def bad(where: str, what: str):
        raise SnapshotError(f"not a CUDA memory snapshot we can read: {where} {what}", field_name)

    if not isinstance(snapshot, dict) or "device_traces" not in snapshot or "segments" not in snapshot:
        bad("the top level", "must be a dict with 'segments' and 'device_traces'")
    traces, segments = snapshot["device_traces"], snapshot["segments"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        bad("'device_traces'", "must be a list (one per device) of lists of entries")
    if not isinstance(segments, list):
        bad("'segments'", "must be a list")
    if not (_int(device) and 0 <= device < max(len(traces), 1)):
        raise SnapshotError(f"device {device!r} not in snapshot (it has {len(traces)} device traces)", field_name)
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            bad(f"segments[{i}]", "must be a dict with a list of 'blocks'")
        if not (_u64(seg.get("address")) and _u64(seg.get("total_size")) and _int(seg.get("device", 0))
                and _int(seg.get("stream", 0))):
            bad(f"segments[{i}]", "needs integer 'device' and 'stream', and 'address' and 'total_size' in [0, 2**64)")
        for j, b in enumerate(seg.get("blocks", [])):
            if not isinstance(b, dict) or not _u64(b.get("address")) or not _u64(b.get("size")) \
                    or not _u64(b.get("requested_size", 0)):
                bad(f"segments[{i}].blocks[{j}]", "must be a dict with integer 'address', 'size' and "
                                                  "'requested_size' in [0, 2**64)")
    entries = traces[device] if traces else []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            bad(f"device_traces[{device}][{i}]", f"must be a dict, got {type(e).__name__}")
        action = e.get("action")
        if not isinstance(action, str) or action not in KNOWN_ACTIONS:  # (a str before hashing it)
            bad(f"device_traces[{device}][{i}]", f"has unknown action {_show(action)}; allowed: "
                                                 f"{', '.join(sorted(KNOWN_ACTIONS))}")
        # torch writes an oom's free bytes as `device_free`, not an `addr` (torch/csrc/cuda/memory_snapshot.cpp)
        if action != "snapshot" and not (_u64(e.get("addr", 0 if action == "oom" else None)) and _u64(e.get("size"))):
            bad(f"device_traces[{device}][{i}] ({action})", f"needs integer 'addr' and 'size' >= 0 (and < 2**64), got "
                                                            f"addr {_show(e.get('addr'))}, size {_show(e.get('size'))}")
        if action == "oom" and not _u64(e.get("device_free", 0)):
            bad(f"device_traces[{device}][{i}] (oom)", f"has a 'device_free' that is not an integer in [0, 2**64): "
                                                       f"{_show(e.get('device_free'))}")
        if not _int(e.get("stream", 0)):
            bad(f"device_traces[{device}][{i}]", f"has a 'stream' that is not an integer: {_show(e.get('stream'))}")
        t = e.get("time_us", 0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or not abs(t) < 2.0 ** 63:
            bad(f"device_traces[{device}][{i}]", f"has a 'time_us' that is not a finite number below 2**63: {_show(t)}")
        if not isinstance(e.get("frames", []), list) or not all(_frame(f) for f in e.get("frames", [])):
            bad(f"device_traces[{device}][{i}]", "has 'frames' that are not a list of dicts with a str 'name' and "
                                                 "'filename' and an integer 'line'")
    return entries


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


def parse_snapshot(snapshot: dict, device: int = 0, field_name: str = "trace", *, first_id: int = 0) -> SnapshotTrace:
    """One device's trace as two EventLogs (allocated, reserved) that open with the state at record start."""
    entries = check_shape(snapshot, device, field_name)
    start = start_state(snapshot, entries, device)
    problems = [m for _, m in start.problems]
    max_entries = snapshot.get("max_entries")
    if _int(max_entries) and 0 < max_entries <= len(entries):
        problems.insert(0, f"the trace holds {len(entries):,} entries, the max_entries it was recorded with: the ring "
                           "buffer wrapped and the older entries are lost")
    allocated, reserved, ooms = [], [], []
    streams: dict[int, int] = {0: 0}  # raw stream -> MemoryViz's number (torch/utils/viz/MemoryViz.js stream_name)
    ids = [first_id]

    def block(nbytes: int, name: str, category: Category = Category.UNKNOWN) -> Block:
        ids[0] += 1
        return Block(id=ids[0], nbytes=int(nbytes), category=category, name=name, dtype="?", rank=device,
                     pool=Pool.DEVICE)

    def event(out: list, action: Action, blk: Block, entry: dict, op: str, phase: Phase | None = None) -> Event:
        stream = streams.setdefault(entry.get("stream", 0), len(streams))
        ev = Event(seq=len(allocated) + len(reserved), time=entry.get("time_us", 0) / 1e6, action=action, block=blk,
                   phase=phase or _phase_of(entry.get("frames", [])), step=0, micro_batch_index=-1,
                   stream=Stream.COMPUTE, op=op if stream == 0 else f"{op} (stream {stream})")
        out.append(ev)
        return ev

    # the state at record start, as allocations at the trace's start (segments first: they hold the blocks)
    t0 = {"time_us": entries[0].get("time_us", 0) if entries else 0}
    dump_frames = {b["address"]: b.get("frames", []) for s in snapshot["segments"] if s.get("device", 0) == device
                   for b in s.get("blocks", []) if b.get("state") in LIVE_STATES}
    freed_by = {e["addr"]: e.get("frames", []) for e in reversed(entries) if e["action"] == "free_completed"}
    live_segments: dict[int, Block] = {}
    for a, (size, stream, _) in sorted(start.segments.items()):
        live_segments[a] = block(size, f"pre-existing segment@{a:#x}")
        event(reserved, Action.ALLOC, live_segments[a], {**t0, "stream": stream}, PREEXISTING_OP, Phase.LOAD)
    live: dict[int, Block] = {}
    for a, (_, requested) in sorted(start.blocks.items()):
        frames = dump_frames.get(a) if a in dump_frames and a not in freed_by else None
        where = f" {_frame_name(frames)}" if frames else (f" (freed at {_frame_name(freed_by[a])})"
                                                          if freed_by.get(a) else "")
        live[a] = block(requested, f"pre-existing@{a:#x}{where}")
        event(allocated, Action.ALLOC, live[a], t0, PREEXISTING_OP, Phase.LOAD)
    running = sum(b.nbytes for b in live.values())

    def release(addr: int, size: int, e: dict, action: str) -> None:
        """Free the reserved ranges [addr, addr + size) touches; what of them stays mapped is allocated anew."""
        end = addr + size
        for a in sorted(a for a, b in live_segments.items() if a < end and a + b.nbytes > addr):
            old = live_segments.pop(a)
            event(reserved, Action.FREE, old, e, action)
            for lo, hi in ((a, max(a, addr)), (min(a + old.nbytes, end), a + old.nbytes)):
                if hi > lo:
                    live_segments[lo] = block(hi - lo, f"segment@{lo:#x} (what {action} left)")
                    event(reserved, Action.ALLOC, live_segments[lo], e, action)

    for e in entries:
        action, addr, size = e["action"], e.get("addr"), e.get("size", 0)
        if action == "alloc":
            old = live.pop(addr, None)
            if old is not None:  # inconsistent (already a problem of the walk back): the old block ends here
                running -= old.nbytes
                event(allocated, Action.FREE, old, e, "free_completed")
            cat = CATEGORY_NAMES.get(str(e.get("category", "unknown")).lower(), Category.UNKNOWN)
            live[addr] = block(size, _frame_name(e.get("frames", [])), cat)
            running += size
            event(allocated, Action.ALLOC, live[addr], e, "alloc")
        elif action == "free_completed":
            blk = live.pop(addr, None)
            if blk is not None:
                running -= blk.nbytes
                event(allocated, Action.FREE, blk, e, "free_completed")
        elif action in ("segment_alloc", "segment_map"):
            if addr in live_segments:
                release(addr, size, e, action)
            live_segments[addr] = block(size, f"segment@{addr:#x} {_frame_name(e.get('frames', []))}")
            event(reserved, Action.ALLOC, live_segments[addr], e, action)
        elif action in ("segment_free", "segment_unmap"):
            release(addr, size, e, action)
        elif action == "oom":
            blk = block(size, _frame_name(e.get("frames", [])))
            by_cat: dict[Category, int] = {}
            for b in live.values():
                by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
            ev = Event(seq=len(allocated) + len(reserved), time=e.get("time_us", 0) / 1e6, action=Action.ALLOC,
                       block=blk, phase=_phase_of(e.get("frames", [])), step=0, micro_batch_index=-1,
                       stream=Stream.COMPUTE, op="oom")
            ooms.append(OOMRecord(event=ev, capacity=running + int(e.get("device_free", 0) or 0), live_bytes=running,
                                  live_by_category=by_cat,
                                  largest_live=tuple(sorted(live.values(), key=lambda b: -b.nbytes)[:10])))
    meta = RunMetadata(device=device, entries=len(entries), streams=list(streams),
                       preexisting_blocks=len(start.blocks), preexisting_segments=len(start.segments))
    return SnapshotTrace(device=device, allocated=EventLog(allocated, "cuda-snapshot", meta, ooms),
                         reserved=EventLog(reserved, "cuda-snapshot-reserved", meta), truncated=bool(problems),
                         problems=problems, preexisting=len(start.blocks),
                         preexisting_bytes=sum(r for _, r in start.blocks.values()),
                         preexisting_segments=len(start.segments),
                         preexisting_reserved=sum(s for s, _, _ in start.segments.values()))


def parse_snapshot_devices(snapshot: dict, field_name: str = "trace") -> list[SnapshotTrace]:
    """Every device of a snapshot, in device order (block ids unique across them)."""
    check_shape(snapshot, 0, field_name)
    out: list[SnapshotTrace] = []
    for d in range(max(len(snapshot["device_traces"]), 1)):
        first = max((e.block.id for t in out for log in (t.allocated, t.reserved) for e in log.events), default=0)
        out.append(parse_snapshot(snapshot, d, field_name, first_id=first))
    return out


def merge_devices(traces: list[SnapshotTrace]) -> tuple[EventLog, EventLog]:
    """The allocated and reserved logs of several devices as one of each (block rank = device), merged by time
    (each device keeps its own order); `seq` numbers both together, so one view's events place among the other's."""
    if len(traces) == 1:
        return traces[0].allocated, traces[0].reserved
    per_device = [sorted([(e.time, t.device, e.seq, 1, view, e) for view, log in ((0, t.allocated), (1, t.reserved))
                          for e in log.events]
                         + [(o.event.time, t.device, o.event.seq, 0, 2, o) for o in t.allocated.ooms],
                         key=lambda x: x[2:4]) for t in traces]  # an oom before the event that follows it
    logs: tuple[list, list, list] = ([], [], [])
    for seq, (*_, view, e) in enumerate(heapq.merge(*per_device, key=lambda x: x[:2])):
        logs[view].append(replace(e, seq=seq) if view < 2 else replace(e, event=replace(e.event, seq=seq)))
    meta = RunMetadata(devices=[t.device for t in traces], entries=sum(t.allocated.metadata.entries for t in traces))
    return (EventLog(logs[0], "cuda-snapshot", meta, logs[2]), EventLog(logs[1], "cuda-snapshot-reserved", meta))


def _read(path: str | Path):
    return safe_loads(read_input(path, "trace", TRACE_FILE_LIMIT))


def load_snapshot(path: str | Path, device: int = 0) -> SnapshotTrace:
    return parse_snapshot(_read(path), device)


def load_snapshot_devices(path: str | Path) -> list[SnapshotTrace]:
    return parse_snapshot_devices(_read(path))
