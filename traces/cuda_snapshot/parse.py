"""One device's trace as two event logs, allocated and reserved, that open with the state at record start
(`parse_snapshot`; every device's: `parse_snapshot_devices`; several as one of each: `merge_devices`); a snapshot
knows no phases or names, so both are read from each entry's stack (`_phase_of`, `_frame_name`)."""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...simulator.events import Action, Block, Category, Event, EventLog, OOMRecord, Phase, Pool, Stream
from ...simulator.run_metadata import RunMetadata
from ...simulator.safe_io import read_input
from .safe_load import TRACE_FILE_LIMIT, TruncatedTraceError, check_shape, is_int, safe_loads
from .start import LIVE_STATES, start_state

PREEXISTING_OP = "pre-existing"  # the op of the events that open a log with the state at record start
CATEGORY_NAMES = {c.value: c for c in Category} | {
    # torch.profiler._memory_profiler.Category names, as _profile_to_snapshot writes them
    "parameter": Category.PARAMETER, "optimizer_state": Category.OPTIMIZER_STATE, "gradient": Category.GRADIENT,
    "activation": Category.ACTIVATION, "temporary": Category.TEMPORARY, "input": Category.INPUT,
    "autograd_detail": Category.TEMPORARY, "unknown": Category.UNKNOWN}


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


def parse_snapshot(snapshot: dict, device: int = 0, field_name: str = "trace", *, first_id: int = 0) -> SnapshotTrace:
    """One device's trace as two EventLogs (allocated, reserved) that open with the state at record start."""
    entries = check_shape(snapshot, device, field_name)
    start = start_state(snapshot, entries, device)
    problems = [m for _, m in start.problems]
    max_entries = snapshot.get("max_entries")
    if is_int(max_entries) and 0 < max_entries <= len(entries):
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
