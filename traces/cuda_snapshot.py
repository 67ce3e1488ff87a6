"""CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`) into the event schema, safely.

A snapshot pickle holds `segments` (what cudaMalloc reserved, with the blocks inside it at dump time)
and `device_traces` (one list per device of alloc / free_requested / free_completed / segment_alloc /
segment_free / segment_map / segment_unmap / oom / snapshot actions, each with addr, size, stream,
time_us and frames). We keep the two views apart:

- allocated: one Block per `alloc`, freed at its `free_completed` (the caching allocator may hand the
  memory back to the user only then; `free_requested` alone is not yet free to reuse);
- reserved: one Block per `segment_alloc` / `segment_map`, freed at `segment_free` / `segment_unmap`.

The trace is a ring buffer (`max_entries`): when it wrapped, early allocations are missing and a free
names a block the trace never allocated. Such a trace is reported `truncated` and its peak is refused
(`TruncatedTraceError`) unless asked for as a lower bound: a wrong peak is worse than none.

Pickles can run code when loaded. `load_snapshot` uses an unpickler that admits no global at all
(a snapshot is plain dicts, lists, strings and numbers); any pickle that names a class or function is
refused with `UnsafePickleError` naming it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from ..simulator.files import InputError, read_input
from ..simulator.events import Action, Block, Category, Event, EventLog, OOMRecord, Phase, Pool, Stream

TRACE_FILE_LIMIT = 512 << 20  # bytes of any trace file (a snapshot, a JSON trace, a gzip'd one unpacked)
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset()
KNOWN_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "oom", "snapshot"}
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
    preexisting: int = 0  # blocks live at dump time that the trace never allocated

    @property
    def block_problems(self) -> list[str]:
        """The problems of the allocated view (segment ones concern the reserved view only)."""
        return [p for p in self.problems if "segment" not in p]

    def peak_bytes(self, allow_truncated: bool = False) -> int:
        if self.truncated and not allow_truncated:
            raise TruncatedTraceError("the trace is truncated (" + "; ".join(self.block_problems[:3]) + "): its peak would "
                                      "be wrong. Record with a larger max_entries, or ask for a lower bound.")
        best = running = 0
        for e in self.allocated.events:
            running += e.delta
            best = max(best, running)
        return best


def _phase_of(frames: list[dict]) -> Phase:
    """A snapshot knows no phases; guess from the Python stack (documented heuristic)."""
    text = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames or ())
    if "torch/optim" in text or "optimizer" in text.lower():
        return Phase.OPTIMIZER
    if "backward" in text or "autograd" in text:
        return Phase.BACKWARD
    return Phase.FORWARD


def _frame_name(frames: list[dict]) -> str:
    for f in frames or ():
        name = f.get("name", "")
        if name and not f.get("filename", "").startswith("??"):
            return f"{f.get('filename', '')}:{f.get('line', 0)}:{name}"
    return "?"


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_shape(snapshot, device: int, field_name: str) -> list[dict]:
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
        for j, b in enumerate(seg.get("blocks", [])):
            if not isinstance(b, dict) or not _int(b.get("address")) or not _int(b.get("size")) or b["size"] < 0:
                bad(f"segments[{i}].blocks[{j}]", "must be a dict with integer 'address' and 'size' >= 0")
    entries = traces[device] if traces else []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            bad(f"device_traces[{device}][{i}]", f"must be a dict, got {type(e).__name__}")
        action = e.get("action")
        if action not in KNOWN_ACTIONS:
            bad(f"device_traces[{device}][{i}]", f"has unknown action {action!r}; allowed: "
                                                 f"{', '.join(sorted(KNOWN_ACTIONS))}")
        if action != "snapshot" and not (_int(e.get("addr")) and _int(e.get("size")) and e["size"] >= 0):
            bad(f"device_traces[{device}][{i}] ({action})", f"needs integer 'addr' and 'size' >= 0, got addr "
                                                            f"{e.get('addr')!r}, size {e.get('size')!r}")
        t = e.get("time_us", 0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or abs(t) == float("inf"):
            bad(f"device_traces[{device}][{i}]", f"has a 'time_us' that is not a finite number: {t!r}")
        if not isinstance(e.get("frames", []), list) or not all(isinstance(f, dict) for f in e.get("frames", [])):
            bad(f"device_traces[{device}][{i}]", "has 'frames' that are not a list of dicts")
    return entries


def parse_snapshot(snapshot: dict, device: int = 0, field_name: str = "trace") -> SnapshotTrace:
    entries = _check_shape(snapshot, device, field_name)
    allocated, reserved, ooms = [], [], []
    live: dict[int, Block] = {}
    live_segments: dict[int, Block] = {}
    problems: list[str] = []
    next_id = 0
    running = 0

    def event(action: Action, block: Block, entry: dict, op: str) -> Event:
        return Event(seq=len(allocated) + len(reserved), time=entry.get("time_us", 0) / 1e6, action=action,
                     block=block, phase=_phase_of(entry.get("frames", [])), step=0, micro_batch=-1,
                     stream=Stream.COMPUTE, op=op)

    for i, e in enumerate(entries):
        action, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if action == "alloc":
            if addr in live:
                problems.append(f"entry {i}: alloc at {addr:#x} which is already allocated")
            next_id += 1
            cat = CATEGORY_NAMES.get(str(e.get("category", "unknown")).lower(), Category.UNKNOWN)
            blk = Block(id=next_id, nbytes=int(size), category=cat, name=_frame_name(e.get("frames", [])),
                        dtype="?", rank=device, pool=Pool.DEVICE)
            live[addr] = blk
            running += blk.nbytes
            allocated.append(event(Action.ALLOC, blk, e, "alloc"))
        elif action == "free_completed":
            blk = live.pop(addr, None)
            if blk is None:
                problems.append(f"entry {i}: free of unknown block {addr:#x} ({size} B): its alloc is not in the trace")
                continue
            running -= blk.nbytes
            allocated.append(event(Action.FREE, blk, e, "free_completed"))
        elif action in ("segment_alloc", "segment_map"):
            next_id += 1
            seg = Block(id=next_id, nbytes=int(size), category=Category.UNKNOWN, name=f"segment@{addr:#x}",
                        dtype="?", rank=device, pool=Pool.DEVICE)
            live_segments[(addr, next_id)] = seg
            reserved.append(event(Action.ALLOC, seg, e, action))
        elif action in ("segment_free", "segment_unmap"):
            key = next((k for k in live_segments if k[0] == addr), None)
            if key is None:
                problems.append(f"entry {i}: {action} of unknown segment {addr:#x}")
                continue
            reserved.append(event(Action.FREE, live_segments.pop(key), e, action))
        elif action == "oom":
            next_id += 1
            blk = Block(id=next_id, nbytes=int(size), category=Category.UNKNOWN, name=_frame_name(e.get("frames", [])),
                        dtype="?", rank=device)
            ev = event(Action.ALLOC, blk, e, "oom")
            by_cat: dict[Category, int] = {}
            for b in live.values():
                by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
            capacity = running + int(e.get("device_free", 0))
            ooms.append(OOMRecord(event=ev, capacity=capacity, live_bytes=running, live_by_category=by_cat,
                                  largest_live=tuple(sorted(live.values(), key=lambda b: -b.nbytes)[:10])))
    at_dump = {b["address"]: b for seg in snapshot["segments"] if seg.get("device", device) == device
               for b in seg.get("blocks", []) if b.get("state") == "active_allocated"}
    preexisting = [a for a in at_dump if a not in live]
    # a segment_free of a segment reserved before the recording began is state at record start (the
    # reserved view starts mid-run), not a wrapped ring buffer; only a free of an unknown *block* makes the
    # allocated view incomplete
    truncated = any("unknown block" in p for p in problems)
    if preexisting and truncated:
        problems.append(f"{len(preexisting)} blocks live at dump time were never allocated in the trace")
    if preexisting and not truncated:
        # allocated before recording started and never freed since: live for the whole trace
        start = {"time_us": entries[0].get("time_us", 0) if entries else 0}
        head = []
        for a in preexisting:
            next_id += 1
            b = at_dump[a]
            blk = Block(id=next_id, nbytes=int(b.get("size", 0)), category=Category.UNKNOWN,
                        name=f"preexisting@{a:#x}", dtype="?", rank=device)
            head.append(event(Action.ALLOC, blk, start, "preexisting"))
        allocated = [Event(**{**e.__dict__, "seq": i}) for i, e in enumerate(head + allocated)]
    meta = {"device": device, "entries": len(entries)}
    return SnapshotTrace(device=device, allocated=EventLog(allocated, "cuda-snapshot", meta, ooms),
                         reserved=EventLog(reserved, "cuda-snapshot-reserved", meta), truncated=truncated,
                         problems=problems, preexisting=len(preexisting))


def load_snapshot(path: str | Path, device: int = 0) -> SnapshotTrace:
    return parse_snapshot(safe_loads(read_input(path, "trace", TRACE_FILE_LIMIT)), device)
