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

The package's modules
---------------------
    safe_load.py  the file loaded without running code and checked for the shape torch writes: `safe_loads`,
                  `check_shape`, the errors (`SnapshotError`, `UnsafePickleError`, `TruncatedTraceError`)
    start.py      the state at record start, rebuilt by walking the trace back from the final segments:
                  `start_state`, `final_state`, `StartState`
    parse.py      one device's trace as the two event logs, every device's, merged: `parse_snapshot`,
                  `parse_snapshot_devices`, `merge_devices`, `SnapshotTrace`, `load_snapshot`
"""

from .parse import (
    CATEGORY_NAMES,
    PREEXISTING_OP,
    SnapshotTrace,
    load_snapshot,
    load_snapshot_devices,
    merge_devices,
    parse_snapshot,
    parse_snapshot_devices,
)
from .safe_load import (
    ALLOWED_GLOBALS,
    KNOWN_ACTIONS,
    TRACE_FILE_LIMIT,
    SnapshotError,
    TruncatedTraceError,
    UnsafePickleError,
    check_shape,
    safe_loads,
)
from .start import LIVE_STATES, StartState, final_state, start_state

__all__ = ["TRACE_FILE_LIMIT", "ALLOWED_GLOBALS", "KNOWN_ACTIONS", "PREEXISTING_OP", "LIVE_STATES", "CATEGORY_NAMES",
           "SnapshotError", "UnsafePickleError", "TruncatedTraceError", "safe_loads", "check_shape", "StartState",
           "final_state", "start_state", "SnapshotTrace", "parse_snapshot", "parse_snapshot_devices", "merge_devices",
           "load_snapshot", "load_snapshot_devices"]
