"""Reading measured peaks out of CUDA memory snapshots, shared by bench/validate_gpu_truth.py (the shared CS336
snapshots) and bench/validate_gpu.py (snapshots this project records).

`measured_peaks(trace)`: allocated = the highest sum of live requested bytes, the state at record start included
(blocks allocated before recording began count from the first event on); reserved = the highest reserved bytes
after the trace's opening empty_cache() (a run of `segment_free` events before any other event releases a previous
configuration's cache: its state is not this program's); a snapshot with no trace (segments only): what it holds.
`read_snapshot(path)`: a snapshot pickle, plain or gzip'd (as traces/store.py reads traces), through the restricted
loader of traces/cuda_snapshot/safe_load.py (`read_raw_snapshot`: the loaded dict itself).
`allocator_replay(snapshot)`: the recorded allocation sequence replayed through peakledger's caching-allocator model,
with the model's own segment addresses and with the ones cudaMalloc returned in the recording: separates what the
allocator rules get wrong from what the predicted program does differently.
"""

from __future__ import annotations

from pathlib import Path

from peakledger.simulator.allocator import AllocatorConfig, CachingAllocator
from peakledger.simulator.events import Action
from peakledger.simulator.safe_io import read_input
from peakledger.traces.cuda_snapshot import TRACE_FILE_LIMIT, SnapshotTrace, parse_snapshot, safe_loads
from peakledger.traces.store import _unpacked


def measured_peaks(trace: SnapshotTrace) -> dict:
    """{"allocated": bytes, "reserved": bytes} of one device's snapshot trace (see the module docstring)."""
    running = best = 0
    for e in trace.allocated.events:
        running += e.delta
        best = max(best, running)
    reserved = opened = 0
    reserved_peak = 0
    for e in trace.reserved.events:
        reserved += e.delta
        if e.op != "pre-existing" and not (e.action is Action.FREE and not opened):
            opened = 1  # past the opening empty_cache()
        if opened:
            reserved_peak = max(reserved_peak, reserved)
    if not opened:  # no trace (segments only): what it holds
        reserved_peak = reserved
    return {"allocated": best, "reserved": reserved_peak}


def read_raw_snapshot(path: str | Path) -> dict:
    """A snapshot pickle, plain or gzip'd (told by its magic bytes, within the trace cap), as the dict it holds."""
    return safe_loads(_unpacked(read_input(path, "trace", TRACE_FILE_LIMIT), path, "trace"))


def read_snapshot(path: str | Path, device: int = 0) -> SnapshotTrace:
    """One device of a snapshot pickle, plain or gzip'd (told by its magic bytes, within the trace cap)."""
    return parse_snapshot(read_raw_snapshot(path), device)


def allocator_replay(snapshot: dict, torch_version: str, device: int = 0, alloc_conf: str = "") -> dict | None:
    """The device's recorded allocs and frees, in order, replayed through the caching-allocator model
    (simulator/allocator, `torch_version`'s rules) twice: with the model's own addresses for new segments (ascending,
    as a simulation places them) and with the addresses the recording's segment_alloc events got from cudaMalloc.
    Best fit breaks ties between free blocks of one size by address (CUDACachingAllocator.cpp BlockComparatorSize:
    stream, size, address), so where the driver put each segment can change which block serves a request.
    {"reserved": peak reserved with the model's addresses, "reserved_at_recorded_addresses": the same with the
    recorded ones, "blocks_where_recorded": every block got the address torch gave it (that replay only), "allocs"};
    None when the trace does not start from an empty allocator (segments or blocks before its first event), uses
    more than one stream, or asks for a segment the recording did not make."""
    trace = [e for e in snapshot.get("device_traces", [])[device] if e["action"] in
             ("alloc", "free_completed", "segment_alloc", "segment_free")] if snapshot.get("device_traces") else []
    while trace and trace[0]["action"] == "segment_free":  # the opening empty_cache() of a previous configuration
        trace.pop(0)
    if (not trace or trace[0]["action"] not in ("alloc", "segment_alloc")
            or len({e.get("stream", 0) for e in trace}) > 1):
        return None
    recorded = [e["addr"] for e in trace if e["action"] == "segment_alloc"]
    out: dict = {"allocs": sum(e["action"] == "alloc" for e in trace)}
    for key, use_recorded in (("reserved", False), ("reserved_at_recorded_addresses", True)):
        taken = iter(recorded)
        model = CachingAllocator(AllocatorConfig.parse(alloc_conf, torch_version),
                                 segment_address=(lambda size, stream: next(taken, None)) if use_recorded else None)
        live: dict[int, int] = {}
        peak, where = 0, True
        for e in trace:
            if e["action"] == "alloc":
                try:
                    addr = model.malloc(e["size"], e.get("stream", 0))
                except (TypeError, ValueError):  # a segment the recording did not make: no address to give it
                    return None
                if addr is None:
                    return None
                live[e["addr"]] = addr
                where = where and addr == e["addr"]
                peak = max(peak, model.reserved)
            elif e["action"] == "free_completed":
                if e["addr"] not in live:  # a block from before the trace
                    return None
                model.free(live.pop(e["addr"]))
        out[key] = peak
        if use_recorded:
            out["blocks_where_recorded"] = where
    return out


__all__ = ["allocator_replay", "measured_peaks", "read_raw_snapshot", "read_snapshot"]
