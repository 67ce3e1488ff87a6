"""A run as a CUDA memory snapshot: what `torch.cuda.memory._snapshot()` returns, for torch's own tools.

On a CUDA device profile the snapshot is the modelled caching allocator's view of the run, rank by rank (one
device per rank): each rank's device events are replayed through the allocator model as `gpu_memory`
(analysis/device.py, simulator/device_memory.py) replays them: the same settings (`alloc_conf`, `torch_version`),
the same capacity (the run's budget less what lies outside the allocator), the same streams, the same
`empty_cache()` before a checkpoint save, the same free-the-cache-and-retry on an OOM, after which it goes on as
the report does (without a capacity); a run stopped at an OOM (`--stop-at-oom`) ends with that allocation failing
in the model too (the cached segments it freed trying, then the `oom` entry). So the file holds:

- `segments`: the allocator's segments at the end of the run, one per cudaMalloc still held (an expandable
  segment: one per mapped range, as torch reports them), each tiled exactly by its blocks in address order
  (`active_allocated` blocks with the tensor's requested size and the frames of its allocation, `inactive` cached
  free blocks), with `segment_type` small/large, its stream, and the allocated/active/requested totals;
- `device_traces[rank]`: every allocator action in order: `segment_alloc` / `segment_free` (and `segment_map` /
  `segment_unmap` with expandable segments) before the `alloc` that caused them, `alloc` (the tensor's bytes, its
  `category`), `free_requested` + `free_completed`, `oom` (`size`: the allocation that failed, `device_free`).
  Each entry has `addr`, `size`, `stream` (0 compute, 1 communication), `time_us` (simulated time) and `frames`:
  innermost `{filename: op, line: step, name: tensor}`, then `{filename: "step", line: step, name: phase}`.

Addresses are the model's own (deterministic, from 2**44 up; not a real device's). Segment trace entries carry
`category: "unknown"`, so that torch's MemoryViz finds that category among those it colours by. An `oom` entry
carries `device_free` and no `addr`, as torch writes it (torch/csrc/cuda/memory_snapshot.cpp).

On the "cpu" profile there is no caching allocator: c10's CPU allocator takes each tensor from the system and
gives it back when it is freed, nothing cached. The snapshot says that: one segment per live tensor (a
`segment_alloc` before each `alloc`, a `segment_free` after each `free_completed`), holding one block, so reserved
= allocated blocks at every moment. Its sizes are in the format's unit, the tensor's bytes rounded up to 512 B
(readers of the format, peakledger's own included, take a block to span at least that; the CPU allocator's own
rounding, malloc's, is not modelled); `alloc` entries and `requested_size` are the tensor's exact bytes, so the
allocation timeline is exact. Host-pool blocks never appear (a CUDA snapshot holds device memory only).
"""

from __future__ import annotations

from ..models.training import StepPlan
from ..simulator.allocator import AllocatorConfig, CachingAllocator, OutOfMemory, allocation_size, pool_of, round_size
from ..simulator.device_memory import STREAM_IDS
from ..simulator.events import Action, Event, EventLog, Phase, Pool
from .device import context_of, cuda_profile, outside_allocator, torch_rules

CPU_BASE = 1 << 44  # where the cpu profile's synthetic addresses start (the allocator model's own first address)
SEGMENT_CATEGORY = "unknown"
EMPTY_CACHE_FRAME = {"filename": "torch/cuda/memory.py", "line": 0, "name": "empty_cache"}


def device_events(log: EventLog) -> dict[int, list[Event]]:
    """Each rank's device-pool events, in log order (ranks in order; rank 0 when there are none); blocks outside
    torch's caching allocator (Block.outside_allocator) are not in its snapshot."""
    out: dict[int, list[Event]] = {}
    for e in log.events:
        if e.block.pool is Pool.DEVICE and not e.block.outside_allocator:
            out.setdefault(e.block.rank, []).append(e)
    return dict(sorted(out.items())) or {0: []}


class _Frames:
    """Frames per event; the outer (phase) frame is one shared dict per (step, phase, micro-batch), so the pickle
    stores it once."""

    def __init__(self) -> None:
        self._outer: dict[tuple, dict] = {}

    def __call__(self, e: Event) -> list[dict]:
        key = (e.step, e.phase, e.micro_batch_index)
        outer = self._outer.get(key)
        if outer is None:
            mb = f" micro-batch {e.micro_batch_index}" if e.micro_batch_index >= 0 else ""
            outer = self._outer[key] = {"filename": "step", "line": e.step, "name": f"{e.phase.value}{mb}"}
        return [{"filename": e.op, "line": e.step, "name": e.block.name}, outer]


def _time_us(e: Event) -> int:
    return int(round(e.time * 1e6))


def _entry(action: str, addr: int, size: int, stream: int, t: int, frames: list, **extra) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": frames, **extra}


def _segment(device: int, addr: int, size: int, stream: int, pool: str, expandable: bool, frames: list,
             blocks: list[dict]) -> dict:
    active = [b for b in blocks if b["state"] == "active_allocated"]
    pending = [b for b in blocks if b["state"] == "active_pending_free"]
    return {"device": device, "address": addr, "total_size": size,
            "allocated_size": sum(b["size"] for b in active),
            "active_size": sum(b["size"] for b in active + pending),
            "requested_size": sum(b["requested_size"] for b in active + pending), "stream": stream,
            "segment_type": pool, "segment_pool_id": (0, 0), "is_expandable": expandable, "frames": frames,
            "blocks": blocks}


def _cuda_device(log: EventLog, rank: int, events: list[Event], frames_of: _Frames) -> tuple[list[dict], list[dict]]:
    """One rank through the allocator model, as analysis/device.py `gpu_memory(log, rank)` replays it: its final
    segments and its trace."""
    meta = log.metadata
    capacity = meta.device_capacity
    fixed = context_of(log).bytes + sum(outside_allocator(log).values())
    limit = None if capacity is None else max(0, capacity - fixed)
    config = AllocatorConfig.parse("" if meta.alloc_conf is None else meta.alloc_conf, torch_rules(log))
    alloc = CachingAllocator(config, capacity=limit)
    before = frozenset({Phase.CHECKPOINT}) if meta.empty_cache_before_save else frozenset()
    trace: list[dict] = []
    addr_of: dict[int, int] = {}  # block id -> the address the allocator gave it
    born: dict[int, list] = {}  # block address -> the frames of its alloc
    seg_frames: dict[int, list] = {}  # segment address -> the frames of the alloc that made it
    done = 0  # the allocator's segment events already in the trace

    def segment_events(t: int, frames: list) -> None:
        nonlocal done
        for ev in alloc.events[done:]:
            trace.append(_entry(ev.kind, ev.addr, ev.size, ev.stream, t, frames, category=SEGMENT_CATEGORY))
            if ev.kind == "segment_alloc":
                seg_frames[ev.addr] = frames
            elif ev.kind == "segment_map":  # an expandable segment's range: named by the first mapping of it
                seg_frames.setdefault(ev.addr, frames)
        done = len(alloc.events)

    def oom(e: Event) -> None:
        """The allocation of `e` failed (after the allocator freed its cache and retried): torch's oom entry."""
        t, frames = _time_us(e), frames_of(e)
        segment_events(t, frames)  # what it freed of its cache before giving up
        trace.append({"action": "oom", "device_free": max(0, (limit or 0) - alloc.reserved),
                      "size": allocation_size(round_size(e.block.nbytes)), "stream": STREAM_IDS[e.stream],
                      "time_us": t, "frames": frames})

    phase = None
    for e in events:
        b = e.block
        if e.phase is not phase:
            phase = e.phase
            if phase in before:
                alloc.empty_cache()
                segment_events(_time_us(e), [EMPTY_CACHE_FRAME])
        if e.action is Action.ALLOC:
            if b.nbytes <= 0:
                continue  # a zero-byte tensor takes no block: the allocator returns a null pointer, records nothing
            t, frames, stream = _time_us(e), frames_of(e), STREAM_IDS[e.stream]
            try:
                a = alloc.malloc(b.nbytes, stream)
            except OutOfMemory:
                oom(e)
                if alloc.config.garbage_collection_threshold:
                    break  # gpu_memory stops here too: the threshold is a share of the capacity
                alloc.capacity = None  # as gpu_memory: on, as if the device were larger (what the run needs)
                a = alloc.malloc(b.nbytes, stream)
            segment_events(t, frames)
            addr_of[b.id] = a
            born[a] = frames
            trace.append(_entry("alloc", a, b.nbytes, stream, t, frames, category=b.category.value))
        else:
            a = addr_of.pop(b.id, None)
            if a is None:
                continue
            stream = alloc.blocks[a].segment.stream
            alloc.free(a)
            born.pop(a, None)
            t, frames = _time_us(e), frames_of(e)
            trace.append(_entry("free_requested", a, b.nbytes, stream, t, frames))
            trace.append(_entry("free_completed", a, b.nbytes, stream, t, frames))
    failed = _stopped_at(log, rank)
    if failed is not None and failed.block.nbytes > 0:  # the allocation the run stopped at: it fails here too
        try:
            alloc.free(alloc.malloc(failed.block.nbytes, STREAM_IDS[failed.stream]))
        except OutOfMemory:
            oom(failed)
    segments = []
    for seg in sorted(alloc.segments.values(), key=lambda s: s.addr):
        ranges: list[list] = []  # [start, blocks]: the segment, or each mapped range of an expandable one
        for blk in seg.blocks():
            if not blk.mapped:
                ranges.append([])
                continue
            if not ranges or not ranges[-1]:
                ranges.append([blk.addr, []])
            state = "active_allocated" if blk.allocated else ("inactive" if blk.free else "active_pending_free")
            active = state != "inactive"
            ranges[-1][1].append({"address": blk.addr, "size": blk.size,
                                  "requested_size": blk.requested if active else 0, "state": state,
                                  "frames": born.get(blk.addr, []) if active else []})
        for r in ranges:
            if r:  # a plain segment's size is its cudaMalloc's; a mapped range's, that of its blocks
                size = sum(x["size"] for x in r[1]) if seg.expandable else seg.size
                segments.append(_segment(rank, r[0], size, seg.stream, seg.pool, seg.expandable,
                                         seg_frames.get(r[0], []), r[1]))
    return segments, trace


def _stopped_at(log: EventLog, rank: int) -> Event | None:
    """The device allocation of `rank` a run stopped at (its OOM record's event; the log ends before it)."""
    if not log.metadata.stopped_at_oom:
        return None
    return next((o.event for o in log.ooms if o.event.block.rank == rank and o.event.block.pool is Pool.DEVICE
                 and o.event.action is Action.ALLOC), None)


def _cpu_device(log: EventLog, rank: int, events: list[Event], frames_of: _Frames) -> tuple[list[dict], list[dict]]:
    """One rank on the cpu profile: each tensor its own allocation from the system, one segment of one block, in
    the format's 512 B unit (see the module docstring)."""
    trace: list[dict] = []
    live: dict[int, dict] = {}  # block id -> its segment at the end
    addr_of: dict[int, int] = {}
    next_addr = CPU_BASE
    for e in events:
        b = e.block
        if e.action is Action.ALLOC:
            if b.nbytes <= 0:
                continue
            size = round_size(b.nbytes)
            a, next_addr = next_addr, next_addr + size
            t, frames, stream = _time_us(e), frames_of(e), STREAM_IDS[e.stream]
            addr_of[b.id] = a
            trace.append(_entry("segment_alloc", a, size, stream, t, frames, category=SEGMENT_CATEGORY))
            trace.append(_entry("alloc", a, b.nbytes, stream, t, frames, category=b.category.value))
            live[b.id] = _segment(rank, a, size, stream, pool_of(size), False, frames, [
                {"address": a, "size": size, "requested_size": b.nbytes, "state": "active_allocated",
                 "frames": frames}])
        elif b.id in addr_of:
            a, seg = addr_of.pop(b.id), live.pop(b.id)
            t, frames = _time_us(e), frames_of(e)
            for action in ("free_requested", "free_completed"):
                trace.append(_entry(action, a, b.nbytes, seg["stream"], t, frames))
            trace.append(_entry("segment_free", a, seg["total_size"], seg["stream"], t, frames,
                                category=SEGMENT_CATEGORY))
    failed = _stopped_at(log, rank)
    record = next((o for o in log.ooms if o.event is failed), None)
    if record is not None:  # the system could not give the tensor: device_free what the capacity had left
        trace.append({"action": "oom", "device_free": max(0, record.capacity - record.live_bytes),
                      "size": failed.block.nbytes, "stream": STREAM_IDS[failed.stream], "time_us": _time_us(failed),
                      "frames": frames_of(failed)})
    return sorted(live.values(), key=lambda s: s["address"]), trace


def allocator_settings(log: EventLog) -> dict:
    """The settings the replay used, under torch's own keys (torch.cuda.memory._snapshot()'s
    `allocator_settings`); empty on the cpu profile."""
    if cuda_profile(log) is None:
        return {}
    conf = log.metadata.alloc_conf or ""
    c = AllocatorConfig.parse(conf, torch_rules(log))
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": -1 if c.max_split_size is None else c.max_split_size,
            "garbage_collection_threshold": float(c.garbage_collection_threshold),
            "expandable_segments": bool(c.expandable_segments),
            "roundup_power2_divisions": list(c.roundup_power2_divisions)}


def to_snapshot(log: EventLog) -> dict:
    """The run in torch.cuda.memory._snapshot() format (see the module docstring): one device per rank;
    `device_traces` has an entry (maybe empty) for every rank up to the highest simulated one."""
    per_rank = device_events(log)
    cuda = cuda_profile(log) is not None
    frames_of = _Frames()
    traces: list[list[dict]] = [[] for _ in range(max(per_rank) + 1)]
    segments: list[dict] = []
    for rank, events in per_rank.items():
        segs, trace = (_cuda_device(log, rank, events, frames_of) if cuda
                       else _cpu_device(log, rank, events, frames_of))
        segments += segs
        traces[rank] = trace
    plan = StepPlan.of(log.metadata)
    about = {"source": log.source, "device": "" if log.metadata.device is None else log.metadata.device,
             "allocator": ("the CUDA caching allocator model (simulator/allocator), torch "
                           f"{torch_rules(log)}" if cuda
                           else "none (cpu profile): one segment per tensor"),
             "addresses": "the model's, not a real device's"}
    if plan.truncated:
        about["steps"] = f"the simulated steps only, of {plan.steps} steps: {plan.summary()}"
    return {"segments": segments, "device_traces": traces, "allocator_settings": allocator_settings(log),
            "external_annotations": [], "peakledger": about}
