"""A run's memory on a CUDA device profile: allocated, reserved, fragmentation and the device total.

`gpu_memory(log, rank)` replays the log through the caching-allocator model (simulator/device_memory.py)
with what lies outside the allocator: the CUDA context, cuBLAS and the kernels a training step loads, measured
for the device profile and the run's `torch_version` where models/cuda_context.py has a measurement, assumed
(and labelled so) where not (`context_of`), and, with data parallelism, NCCL's buffers (models/gpu.py,
assumed). The allocator settings are the run's `alloc_conf` (PYTORCH_CUDA_ALLOC_CONF syntax, in the log's
metadata). On the "cpu" profile there is no caching allocator to model, and the functions here return None.

`fits(log, rank, budget)` is the OOM decision on a GPU: the allocator under a capacity of `budget`,
with its free-the-cache-and-retry rule, not the allocated bytes against the budget.
"""

from __future__ import annotations

from ..models.cuda_context import ASSUMED_ROW, CudaContext
from ..models.devices import DEVICES, DeviceProfile
from ..models.gpu import nccl_buffer_bytes
from ..simulator.device_memory import DeviceMemory, device_memory
from ..simulator.events import Action, Block, Category, EventLog, OOMRecord, Phase, Pool
from ..simulator.torch_rules import rules_reason
from .units import Scale


def device_settings(scenario) -> dict:
    """A scenario's run fields the allocator reads, as the log's metadata carries them."""
    return {"alloc_conf": scenario.alloc_conf, "torch_version": scenario.torch_version,
            "torch_rules": rules_reason(scenario.torch_version),
            "empty_cache_before_save": scenario.empty_cache_before_save}


def torch_rules(log: EventLog) -> str:
    """The torch version whose rules the run's device follows: the log's `torch_version`, else 2.6's."""
    version = log.metadata.torch_version
    return "2.6" if version is None else version


def cuda_profile(log: EventLog) -> DeviceProfile | None:
    profile = DEVICES.get(log.metadata.device)
    return profile if profile is not None and profile.is_cuda else None


def context_of(log: EventLog) -> CudaContext | None:
    """What the run's device holds outside the allocator besides NCCL's buffers, measured or assumed, for its
    profile and `torch_version` (models/cuda_context.py); None when the device is not a CUDA profile."""
    profile = cuda_profile(log)
    if profile is None:
        return None
    return profile.context(torch_rules(log), log.metadata.setup)


def outside_allocator(log: EventLog) -> dict[str, int]:
    """Buffers outside the allocator besides the context, by name (assumptions of models/gpu.py)."""
    setup = log.metadata.setup
    world = setup.mesh.world_size if setup is not None else 1
    return {"nccl": nccl_buffer_bytes(world)} if world > 1 else {}


def gpu_memory(log: EventLog, rank: int, capacity: int | None = None, series: bool = False,
               events: list | None = None, unbounded: bool = False) -> DeviceMemory | None:
    """The rank through the allocator; `capacity` defaults to the run's budget (`device_capacity` in the log's
    metadata: a run given a budget is a device of that size), `unbounded` asks for none even then. `events`: the
    rank's, if already found (simulator/timeline.py `rank_events`)."""
    profile = cuda_profile(log)
    if profile is None:
        return None
    stop = capacity is not None  # an explicit capacity asks where the OOM is; the run's budget, what it needs
    md = log.metadata
    if capacity is None and not unbounded:
        capacity = md.device_capacity
    before = frozenset({Phase.CHECKPOINT}) if md.empty_cache_before_save else frozenset()
    return device_memory(log, rank, "" if md.alloc_conf is None else md.alloc_conf, capacity, context_of(log).bytes,
                         outside_allocator(log), series, before, torch_rules(log), stop, events)


def _context_rows(dm: DeviceMemory, ctx: CudaContext | None) -> list[tuple[str, int, bool, str | None]]:
    """(row, bytes, assumed, source) of what `ctx` says lies outside the allocator; without it (a caller that
    does not know the run), one assumed row of the replay's context."""
    if ctx is None or ctx.bytes != dm.context:
        return [(ASSUMED_ROW, dm.context, True, None)]
    return [(row, nbytes, not ctx.measured, ctx.source) for row, nbytes in ctx.parts]


MAPPED_ROW = "mapped outside the allocator (vLLM's CuMemAllocator pool)"  # simulator/events.py Block.outside_allocator


def device_ledger(dm: DeviceMemory, ctx: CudaContext | None = None) -> list[dict]:
    """The device total at its peak, row by row: the tensors (the allocated ledger), the allocator's rounding and
    cached free blocks, and what lies outside the allocator (`ctx`: measured or assumed; NCCL's buffers, assumed).
    `source`: the measurement's folder, for a row read from one."""
    p = dm.total_peak
    rows = [("allocated (tensors)", p.allocated, False, None), ("allocated: 512 B rounding and unsplit blocks",
                                                                 p.allocated_blocks - p.allocated, False, None),
            ("reserved, unallocated (cached free blocks)", p.fragmentation, False, None)]
    rows += _context_rows(dm, ctx)
    rows += [(f"{name} buffers", nbytes, True, None) for name, nbytes in dm.outside.items()]
    if p.outside_allocator:
        rows.append((MAPPED_ROW, p.outside_allocator, False, None))
    return [{"row": name, "bytes": nbytes, "unit": "B", "assumed": assumed, "source": source}
            for name, nbytes, assumed, source in rows]


def device_json(dm: DeviceMemory | None, ctx: CudaContext | None = None) -> dict:
    """The report's GPU keys (None on the cpu profile): `reserved_peak` and `device_total_peak` read like `peak`
    ({bytes, op, phase, step, ...}); `device_memory` holds the rest: `context_bytes` and `cuda_context` (its rows,
    bytes, whether measured and the measurement's source; `context_of`) are what lies outside the allocator
    besides `outside_allocator` (NCCL's buffers, assumed: `outside_assumed`)."""
    if dm is None:
        return {"reserved_peak": None, "device_total_peak": None, "device_memory": None}
    total = dict(dm.total_peak.as_json(), bytes=dm.total_peak.total)
    at_alloc = dm.at_allocated_peak
    context = ctx.as_json() if ctx is not None and ctx.bytes == dm.context else {
        "bytes": dm.context, "unit": "B", "measured": False, "label": "assumed", "source": None,
        "rows": [{"row": ASSUMED_ROW, "bytes": dm.context}], "measurement": None}
    return {"reserved_peak": dm.reserved_peak.as_json(), "device_total_peak": total, "device_memory": {
        "alloc_conf": dm.alloc_conf, "context_bytes": dm.context, "cuda_context": context,
        "outside_allocator": dm.outside, "outside_assumed": True, "segments_allocated": dm.segment_allocs,
        "segments_freed": dm.segment_frees,
        "at_allocated_peak": at_alloc.as_json(), "ledger_at_device_total_peak": device_ledger(dm, ctx),
        "fragmentation_at_reserved_peak": dm.reserved_peak.fragmentation,
        "largest_free_block_at_reserved_peak": dm.reserved_peak.largest_free}}


def device_lines(dm: DeviceMemory, unit: str | None, ctx: CudaContext | None = None) -> list[str]:
    """The text report's GPU block, its sizes in one unit (`unit`, else the device total's); `ctx` (`context_of`
    the run) labels what lies outside the allocator."""
    rp, ap = dm.reserved_peak, dm.at_allocated_peak
    f = Scale.of([ap.allocated, ap.allocated_blocks, rp.reserved, dm.total_peak.total], unit).text
    e = rp.event
    where = f"at {e.op} ({e.phase.value}, step {e.step})" if e else ""
    outside = ", ".join(f"{k} {f(v)}" for k, v in dm.outside.items())
    return [
        f"GPU memory (caching allocator{', ' + dm.alloc_conf if dm.alloc_conf else ', default settings'}):",
        f"  allocated peak   {f(ap.allocated):>14}  ({f(ap.allocated_blocks)} in 512 B-rounded blocks); reserved "
        f"then {f(ap.reserved)}",
        f"  reserved peak    {f(rp.reserved):>14}  {where}",
        f"  fragmentation    {f(rp.fragmentation):>14}  reserved but unallocated at the reserved peak; largest free "
        f"block {f(rp.largest_free)}",
        f"  device total     {f(dm.total_peak.total):>14}  = "
        + (ctx.text() if ctx is not None and ctx.bytes == dm.context else f"CUDA context {f(dm.context)} (assumed)")
        + (f" + {outside} (assumed)" if outside else "") + " + reserved"
        + (f" + {f(dm.total_peak.outside_allocator)} {MAPPED_ROW}" if dm.total_peak.outside_allocator else "")
        + f"; {dm.segment_allocs:,} cudaMalloc, "
        f"{dm.segment_frees:,} cudaFree",
    ]


def first_gpu_oom(log: EventLog, budget: int) -> tuple[DeviceMemory, int] | None:
    """The earliest OOM over the log's ranks with `budget` bytes of device each: (its replay, its rank)."""
    ranks = sorted({e.block.rank for e in log.events})
    found = [(dm, r) for r in ranks if (dm := gpu_memory(log, r, capacity=budget)) is not None and dm.oom]
    return min(found, key=lambda x: (x[0].oom.index, x[1]), default=None)


def with_gpu_oom(log: EventLog, budget: int, stop: bool, found=False) -> EventLog:
    """The log with the allocator's first OOM under `budget` recorded (as the engine records one, plus torch's
    message); with `stop`, cut at that allocation, which never happened. `found`: `first_gpu_oom(log, budget)`
    when the caller has it already."""
    if found is False:
        found = first_gpu_oom(log, budget)
    if found is None:
        return log
    dm, rank = found
    oom = dm.oom
    index = oom.index  # the failing allocation's event
    event = log.events[index]
    live: dict[int, Block] = {}
    for e in log.events[:index]:
        if e.block.rank == rank and e.block.pool is Pool.DEVICE:
            if e.action is Action.ALLOC:
                live[e.block.id] = e.block
            else:
                live.pop(e.block.id, None)
    by_cat: dict[Category, int] = {}
    for b in live.values():
        by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
    # live_bytes: what the device holds (context, reserved, outside), so live + request - capacity is torch's shortfall
    record = OOMRecord(event=event, capacity=budget, live_bytes=oom.point.total, live_by_category=by_cat,
                       largest_live=tuple(sorted(live.values(), key=lambda b: (-b.nbytes, b.id))[:10]),
                       message=oom.message)
    metadata = log.metadata
    events = log.events
    if stop:
        events = events[:index]
        metadata = metadata.updated(stopped_at_oom=True)
    return EventLog(events=events, source=log.source, metadata=metadata, ooms=[record], op_names=log.op_names)


def gpu_fits(log: EventLog, budget: int) -> bool:
    """The allocator, with its retry rule, serves every rank's requests within `budget`."""
    return first_gpu_oom(log, budget) is None
