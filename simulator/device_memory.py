"""Device memory as a CUDA GPU holds it: the caching allocator under an event log, plus what lies outside it.

An event log (simulated or measured) says which tensors are live; torch's caching allocator decides how
much of the device that takes. `device_memory(log, rank, ...)` replays one rank's device-pool events, in
log order, through the allocator model (simulator/allocator.py): each ALLOC is a `malloc` of the block's
bytes on its stream, each FREE a `free`. Four numbers are kept apart, as the seed calculator asks:

- allocated: the tensors' bytes (the log's own occupancy; torch's memory_allocated counts the blocks, each
  rounded up to 512 B and sometimes larger: `allocated_blocks`);
- reserved: what the allocator holds from the device (torch's memory_reserved);
- fragmentation: reserved - allocated blocks, and the largest free cached block;
- device total: the CUDA context + reserved + buffers outside the allocator (NCCL), what nvidia-smi shows,
  + the live blocks the process maps outside torch's allocator (simulator/events.py `Block.outside_allocator`:
  vLLM's CuMemAllocator pool in sleep mode). Those take no segment: the allocator's room shrinks by their bytes
  while they live. vLLM empties torch's cache before it maps them and after it unmaps them (vllm 0.32.0
  vllm/device_allocator/cumem.py CuMemAllocator.wake_up: `gc.collect(); torch.accelerator.empty_cache()` before
  create_and_map; CuMemAllocator.sleep: `torch.cuda.empty_cache()` after unmap_and_release); the replay does the
  same. One that does not fit is an OOM of its own (cuMemCreate fails; torch's cache is already empty).

With a capacity (the device's bytes, or a budget) a cudaMalloc that would exceed capacity - context -
outside fails; the allocator frees its cache and retries before it raises the OOM, as torch does. The
first OOM is kept with torch's own wording (`torch_oom_message`) and the replay stops there.
Streams: compute is stream 0 and communication stream 1 (a block is reused only on its own stream).
Zero-byte tensors take no block (the allocator returns a null pointer for them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import AllocatorConfig, CachingAllocator, OutOfMemory, allocation_size, round_size
from .events import Action, Event, EventLog, Phase, Pool, Stream

STREAM_IDS = {Stream.COMPUTE: 0, Stream.COMMUNICATION: 1, Stream.HOST: 0}


@dataclass(frozen=True)
class DevicePoint:
    """The device right after log event `index` (-1: before the first)."""

    index: int
    event: Event | None
    allocated: int  # tensor bytes
    allocated_blocks: int  # block bytes (torch's memory_allocated)
    reserved: int
    total: int  # context + reserved + outside the allocator (+ `outside_allocator`)
    largest_free: int  # the largest cached free block
    outside_allocator: int = 0  # live Block.outside_allocator bytes (vLLM's CuMemAllocator pool)

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated (torch: "reserved by PyTorch but unallocated")."""
        return self.reserved - self.allocated_blocks

    def as_json(self) -> dict:
        e = self.event
        return {"bytes": self.reserved, "unit": "B", "op": e.op if e else None, "phase": e.phase.value if e else None,
                "step": e.step if e else None, "micro_batch_index": e.micro_batch_index if e else None,
                "time_s": e.time if e else None, "allocated": self.allocated, "allocated_blocks": self.allocated_blocks,
                "reserved": self.reserved, "device_total": self.total, "fragmentation": self.fragmentation,
                "largest_free_block": self.largest_free, "outside_allocator": self.outside_allocator}


@dataclass(frozen=True)
class DeviceOOM:
    """The first allocation the device could not serve, after the allocator freed its cache and retried."""

    index: int  # the failing ALLOC's index in the log
    point: DevicePoint  # the device just before the failed request
    requested: int  # the tensor's bytes
    segment: int  # the cudaMalloc that failed (the segment size torch reports as "Tried to allocate")
    capacity: int  # the device's (or budget's) bytes
    device: int = 0
    outside_allocator: bool = False  # a Block.outside_allocator mapping failed, not torch's cudaMalloc

    @property
    def message(self) -> str:
        p = self.point
        if self.outside_allocator:
            return cumem_oom_message(self.requested, self.capacity, p.total, p.reserved, self.device)
        return torch_oom_message(self.segment, self.capacity, p.total, p.allocated_blocks, p.reserved, self.device)


@dataclass
class DeviceMemory:
    rank: int
    alloc_conf: str
    context: int
    outside: dict[str, int]  # name -> bytes outside the allocator, besides the context
    capacity: int | None
    reserved_peak: DevicePoint
    at_allocated_peak: DevicePoint  # the first moment of the highest tensor bytes
    oom: DeviceOOM | None
    segment_allocs: int
    segment_frees: int
    series: list[tuple[float, int, int]] = field(default_factory=list)  # (time, allocated, reserved) per event
    alloc_retries: int = 0  # requests served only after the allocator freed its whole cache (num_alloc_retries)
    outside_series: list[int] = field(default_factory=list)  # live Block.outside_allocator bytes per series point
    device_peak: DevicePoint | None = None  # the device total's highest moment, when outside-allocator blocks move it

    @property
    def total_peak(self) -> DevicePoint:
        """The device total's peak: the reserved peak's moment (the context and outside buffers are constant)
        unless blocks outside the allocator (`device_peak`) make another moment higher."""
        return self.reserved_peak if self.device_peak is None else self.device_peak

    @property
    def outside_total(self) -> int:
        return self.context + sum(self.outside.values())


def format_size(size: int) -> str:
    """torch's format_size (c10/cuda/CUDACachingAllocator.cpp): bytes, KiB, MiB or GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def torch_oom_message(segment: int, capacity: int, in_use: int, allocated: int, reserved: int, device: int = 0) -> str:
    """The OutOfMemoryError text of CUDACachingAllocator.cpp's malloc (torch 2.6), for this device state."""
    return (f"CUDA out of memory. Tried to allocate {format_size(segment)}. GPU {device} has a total capacity of "
            f"{format_size(capacity)} of which {format_size(max(0, capacity - in_use))} is free. Including "
            f"non-PyTorch memory, this process has {format_size(in_use)} memory in use. Of the allocated memory "
            f"{format_size(allocated)} is allocated by PyTorch, and {format_size(reserved - allocated)} is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def cumem_oom_message(nbytes: int, capacity: int, in_use: int, reserved: int, device: int = 0) -> str:
    """A failed mapping outside torch's allocator (vLLM's CuMemAllocator: cuMemCreate returns
    CUDA_ERROR_OUT_OF_MEMORY in create_and_map, csrc/cumem_allocator.cpp, vllm 0.32.0)."""
    return (f"CUDA Error: out of memory: vLLM's CuMemAllocator could not map {format_size(nbytes)} (cuMemCreate). "
            f"GPU {device} has a total capacity of {format_size(capacity)} of which "
            f"{format_size(max(0, capacity - in_use))} is free. Including non-PyTorch memory, this process has "
            f"{format_size(in_use)} memory in use, {format_size(reserved)} of it reserved by PyTorch after "
            "emptying its cache.")


def device_memory(log: EventLog, rank: int = 0, alloc_conf: str = "", capacity: int | None = None,
                  context: int = 0, outside: dict[str, int] | None = None, series: bool = False,
                  empty_cache_before: frozenset[Phase] = frozenset(), torch_version: str = "2.6",
                  stop_at_oom: bool = True, events: list[tuple[int, Event]] | None = None) -> DeviceMemory:
    """Replay rank `rank`'s device events through the caching allocator (see the module docstring).
    `empty_cache_before`: phases the program enters with a torch.cuda.empty_cache() call (e.g. a checkpoint save).
    `stop_at_oom` False: after the first OOM the replay goes on without a capacity (what the run would need).
    The garbage-collection threshold stays tied to the capacity it was given (the allowed bytes) until then.
    `events`: the rank's events with their places in the log, if already found (simulator/timeline.py
    `rank_events`), instead of every event of the log."""
    outside = dict(outside or {})
    fixed = context + sum(outside.values())
    limit = None if capacity is None else max(0, capacity - fixed)
    alloc = CachingAllocator(AllocatorConfig.parse(alloc_conf, torch_version), capacity=limit)
    addr: dict[int, int] = {}
    live = 0
    ext = 0  # live Block.outside_allocator bytes: no segment, but the allocator's room and the device total

    def point(i: int, e: Event | None, largest: bool) -> DevicePoint:
        return DevicePoint(i, e, live, alloc.allocated, alloc.reserved, fixed + alloc.reserved + ext,
                           alloc.largest_free() if largest else -1, ext)

    start = point(-1, None, True)
    best_reserved = best_live = best_total = start
    oom = None
    out: list[tuple[float, int, int]] = []
    ext_out: list[int] = []
    phase = None
    device, alloc_action, malloc, free = Pool.DEVICE, Action.ALLOC, alloc.malloc, alloc.free  # (locals: per event)
    for i, e in enumerate(log.events) if events is None else events:
        b = e.block
        if b.rank != rank or b.pool is not device:
            continue
        if e.phase is not phase:
            phase = e.phase
            if phase in empty_cache_before:
                alloc.empty_cache()
        if b.outside_allocator:
            if e.action is Action.ALLOC:
                alloc.empty_cache()
                if alloc.capacity is not None and fixed + alloc.reserved + ext + b.nbytes > capacity:
                    oom = DeviceOOM(i, point(i - 1, e, True), b.nbytes, b.nbytes, capacity, rank, True)
                    if stop_at_oom or alloc.config.garbage_collection_threshold:
                        break
                    alloc.capacity = None
                ext += b.nbytes
            else:
                ext -= b.nbytes
                alloc.empty_cache()
            if alloc.capacity is not None:
                alloc.capacity = max(0, limit - ext)
            if fixed + alloc.reserved + ext > best_total.total:
                best_total = point(i, e, True)
            if series:
                out.append((e.time, live, alloc.reserved))
                ext_out.append(ext)
            continue
        if e.action is alloc_action:
            if b.nbytes > 0:
                try:
                    addr[b.id] = malloc(b.nbytes, STREAM_IDS[e.stream])
                except OutOfMemory:
                    oom = DeviceOOM(i, point(i - 1, e, True), b.nbytes, allocation_size(round_size(b.nbytes)),
                                    capacity, rank)
                    if stop_at_oom or alloc.config.garbage_collection_threshold:
                        break  # (the threshold is a share of the capacity: no going on without one)
                    alloc.capacity = None  # go on as if the device were larger: what the run would need
                    addr[b.id] = alloc.malloc(b.nbytes, STREAM_IDS[e.stream])
            live += b.nbytes
        else:
            a = addr.pop(b.id, None)
            if a is not None:
                free(a)
            live -= b.nbytes
        reserved = alloc.reserved
        if reserved > best_reserved.reserved:
            best_reserved = point(i, e, True)
        if fixed + reserved + ext > best_total.total:
            best_total = best_reserved if best_reserved.index == i else point(i, e, True)
        if live > best_live.allocated:
            best_live = point(i, e, True)
        if series:
            out.append((e.time, live, reserved))
            ext_out.append(ext)
    kinds = [s.kind for s in alloc.events]
    alloc.close()
    return DeviceMemory(rank=rank, alloc_conf=alloc_conf, context=context, outside=outside, capacity=capacity,
                        reserved_peak=best_reserved,
                        at_allocated_peak=best_live, oom=oom, segment_allocs=kinds.count("segment_alloc")
                        + kinds.count("segment_map"), segment_frees=kinds.count("segment_free")
                        + kinds.count("segment_unmap"), series=out, alloc_retries=alloc.alloc_retries,
                        outside_series=ext_out,
                        device_peak=None if best_total.total <= best_reserved.total else best_total)
