"""Reading measured peaks out of CUDA memory snapshots, shared by bench/validate_gpu_truth.py (the shared CS336
snapshots) and bench/validate_gpu.py (snapshots this project records).

`measured_peaks(trace)`: allocated = the highest sum of live requested bytes, the state at record start included
(blocks allocated before recording began count from the first event on); reserved = the highest reserved bytes
after the trace's opening empty_cache() (a run of `segment_free` events before any other event releases a previous
configuration's cache: its state is not this program's); a snapshot with no trace (segments only): what it holds.
`read_snapshot(path)`: a snapshot pickle, plain or gzip'd (as traces/store.py reads traces), through the restricted
loader of traces/cuda_snapshot.py.
"""

from __future__ import annotations

from pathlib import Path

from peakledger.simulator.events import Action
from peakledger.simulator.files import read_input
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


def read_snapshot(path: str | Path, device: int = 0) -> SnapshotTrace:
    """One device of a snapshot pickle, plain or gzip'd (told by its magic bytes, within the trace cap)."""
    data = _unpacked(read_input(path, "trace", TRACE_FILE_LIMIT), path, "trace")
    return parse_snapshot(safe_loads(data), device)


__all__ = ["measured_peaks", "read_snapshot"]
