"""Replay a measured CUDA memory snapshot through the allocator model and compare with what torch did.

1. The state at record start is rebuilt from the snapshot's final `segments` by undoing the trace backwards
   (as torch's MemoryViz does): an `alloc` undone removes the block, a `free_completed` undone puts it back,
   a `segment_alloc` undone removes the segment, a `segment_free` undone puts it back. A block freed during
   the trace but allocated before it is given its rounded size; in the large pool it also takes a following
   free gap of 1 MiB or less (such a gap can only be the leftover the block kept: should_split never leaves a
   large free block of <= 1 MiB).
2. The trace's `alloc` / `free_completed` requests are replayed through `CachingAllocator`, per device (each
   request on its own stream). A new segment takes the address of the trace's pending `segment_alloc` when
   its size is the same, else a synthetic address. A run of `segment_free` events the model did not cause is
   an explicit `torch.cuda.empty_cache()` of the user's: the model is asked to empty its cache there.
3. Compared: the segment events (kind and size, position by position), reserved and allocated peaks, the
   share of trace events after which the predicted reserved equals the measured one, and the final layout
   against the snapshot's `segments` block by block.
"""

from __future__ import annotations

from pathlib import Path

from ..simulator.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from ..simulator.safe_io import read_input
from ..traces.cuda_snapshot import TRACE_FILE_LIMIT, SnapshotError, check_shape, safe_loads
from ..traces.cuda_snapshot import start_state as _start_state


def start_state(snapshot: dict, entries: list[dict], device: int = 0):
    """The segments {addr: (size, stream, pool)} and allocated blocks {addr: (block size, requested)} at record start
    (traces/cuda_snapshot/start.py `start_state`, shared with the snapshot reader)."""
    if any(s.get("is_expandable") for s in snapshot["segments"] if s.get("device", 0) == device):
        raise SnapshotError("the snapshot uses expandable segments, which the allocator model does not model yet")
    state = _start_state(snapshot, entries, device)
    unplaced = next((message for kind, message in state.problems if kind == "unplaced"), None)
    if unplaced is not None:
        raise SnapshotError(unplaced)
    return state.segments, state.blocks


def infer_capacity(entries: list[dict], start_reserved: int) -> dict:
    """What the trace tells of the bytes cudaMalloc could get (the device's capacity less the context and other
    processes), when the snapshot does not record it:
    - an `oom` entry: reserved then + its `device_free` (cudaMemGetInfo's free bytes at the failure), exactly;
    - a free-and-retry: a run of `segment_free` in mid-trace followed at once by the `segment_alloc` of size S
      it made room for (CUDACachingAllocator.cpp malloc: alloc_block failed, release_cached_blocks, retry):
      reserved before the run + S > capacity >= reserved after it + S;
    - always: capacity >= the highest reserved in the trace.
    Returns {"capacity": the least consistent value or None, "low", "high" (None: unbounded), "how"}."""
    reserved, low, high, how = start_reserved, start_reserved, None, []
    i, n, started = 0, len(entries), False
    while i < n:
        e = entries[i]
        action = e["action"]
        if action == "oom":
            exact = reserved + int(e.get("device_free", 0))
            return {"capacity": exact, "low": exact, "high": exact,
                    "how": "the trace's oom entry: reserved then + the device's free bytes it reports"}
        if action == "segment_free" and started:
            before, j = reserved, i
            while j < n and entries[j]["action"] == "segment_free":
                reserved -= entries[j]["size"]
                j += 1
            if j < n and entries[j]["action"] == "segment_alloc":
                size = entries[j]["size"]
                low = max(low, reserved + size)
                high = before + size - 1 if high is None else min(high, before + size - 1)
                how.append(j)
            i = j
            continue
        if action == "segment_alloc":
            reserved += e["size"]
        elif action == "segment_free":
            reserved -= e["size"]
        started = started or action == "alloc"
        low = max(low, reserved)
        i += 1
    if how and high is not None and low <= high:
        return {"capacity": low, "low": low, "high": high,
                "how": f"{len(how)} free-and-retry run(s) of segment_free before a segment_alloc: the least capacity "
                       "that makes each cudaMalloc fail before and succeed after its run"}
    return {"capacity": None, "low": low, "high": None,
            "how": "no oom entry and no free-and-retry in the trace: the device limit was never reached, so the "
                   "capacity is at least the highest reserved"}


def replay_entries(snapshot: dict, device: int = 0, config: AllocatorConfig | None = None,
                   capacity: int | None = None) -> dict:
    entries = check_shape(snapshot, device, "trace")
    segs, blocks = start_state(snapshot, entries, device)
    inferred = infer_capacity(entries, sum(size for size, _, _ in segs.values()))
    if capacity is None:
        capacity = inferred["capacity"]  # None: the trace never reached the limit, and the replay needs none
    pending: list[tuple[int, int]] = []  # the trace's segment_alloc not yet consumed
    synthetic = [1 << 56]

    def address(size: int, stream: int) -> int:
        while pending:
            a, s = pending.pop(0)
            if s == size:
                return a
        synthetic[0] += size
        return synthetic[0] - size

    model = CachingAllocator(config, capacity, address)
    for a, (size, stream, pool) in sorted(segs.items()):
        model.add_segment(a, size, stream, pool,
                          {b: v for b, v in blocks.items() if a <= b < a + size})
    measured_seg: list[tuple[str, int]] = []
    reserved_m = model.reserved
    alloc_m = alloc_p = model.requested
    peaks = {"reserved_m": reserved_m, "reserved_p": reserved_m, "alloc_m": alloc_m, "alloc_p": alloc_p,
             "alloc_block_p": model.allocated}
    addr_map: dict[int, int] = {}
    exact = 0
    addr_matched = allocs = 0
    ooms: list[int] = []
    prev_action = None
    shown = model.reserved  # the predicted reserved as of the trace's position
    seen = 0  # model segment events already shown
    done: dict[int, int | None] = {}  # alloc entries already served (looked ahead from their segment_alloc)

    def serve(j: int) -> None:
        e = entries[j]
        try:
            got = model.malloc(e["size"], e.get("stream", 0))
        except OutOfMemory:
            ooms.append(j)
            got = None
        done[j] = got
        pending.clear()

    for i, e in enumerate(entries):
        action = e["action"]
        if action in ("segment_alloc", "segment_free"):
            measured_seg.append((action, e["size"]))
            reserved_m += e["size"] if action == "segment_alloc" else -e["size"]
            if action == "segment_alloc":
                pending.append((e["addr"], e["size"]))
                # the malloc that caused it is the next alloc: serve it now, as torch did
                j = next((k for k in range(i + 1, len(entries)) if entries[k]["action"] == "alloc"), None)
                if j is not None and j not in done and seen == len(model.events):
                    serve(j)
            elif prev_action != "segment_free" and seen == len(model.events):
                j = _retried_alloc(entries, i) if capacity is not None else None
                if j is not None and j not in done:
                    serve(j)  # the allocator frees its cache and retries by itself at this capacity
                else:
                    model.empty_cache()  # an explicit torch.cuda.empty_cache() of the user's
            if seen < len(model.events):  # one model segment event per trace segment event, in order
                ev = model.events[seen]
                shown += ev.size if ev.kind == "segment_alloc" else -ev.size
                seen += 1
        else:
            if action == "alloc":
                alloc_m += e["size"]
                allocs += 1
                if i not in done:
                    serve(i)
                got = done.pop(i)
                if got is not None:
                    addr_map[e["addr"]] = got
                    addr_matched += got == e["addr"]
            elif action == "free_completed":
                alloc_m -= e["size"]
                got = addr_map.pop(e["addr"], e["addr"])
                if got in model.blocks and model.blocks[got].allocated:
                    model.free(got)
            for ev in model.events[seen:]:
                shown += ev.size if ev.kind == "segment_alloc" else -ev.size
            seen = len(model.events)
        if action != "free_requested":
            prev_action = action
        exact += shown == reserved_m
        peaks["reserved_m"] = max(peaks["reserved_m"], reserved_m)
        peaks["reserved_p"] = max(peaks["reserved_p"], shown)
        peaks["alloc_m"] = max(peaks["alloc_m"], alloc_m)
        peaks["alloc_p"] = max(peaks["alloc_p"], model.requested)
        peaks["alloc_block_p"] = max(peaks["alloc_block_p"], model.allocated)
    predicted_seg = [(ev.kind, ev.size) for ev in model.events]
    matched = sum(1 for m, p in zip(measured_seg, predicted_seg) if m == p)
    first_diff = next((k for k, (m, p) in enumerate(zip(measured_seg, predicted_seg)) if m != p),
                      None if len(measured_seg) == len(predicted_seg) else min(len(measured_seg), len(predicted_seg)))
    final = {}
    for s in snapshot["segments"]:
        if s.get("device", 0) == device:
            final[s["address"]] = [(b["address"], b["size"],
                                    b.get("state") in ("active_allocated", "active_pending_free"))
                                   for b in s.get("blocks", [])]
    return {
        "device": device,
        "trace_events": len(entries),
        "segments_measured": len(measured_seg),
        "segments_predicted": len(predicted_seg),
        "segments_matched": matched,
        "first_segment_difference": first_diff,
        "reserved_peak": {"measured": peaks["reserved_m"], "predicted": peaks["reserved_p"]},
        "allocated_peak": {"measured": peaks["alloc_m"], "predicted": peaks["alloc_p"]},
        "allocated_block_peak_predicted": peaks["alloc_block_p"],
        "reserved_exact_fraction": exact / len(entries) if entries else 1.0,
        "block_addresses_matched": addr_matched,
        "allocs": allocs,
        "final_layout_matches": model.layout() == dict(sorted(final.items())),
        "ooms": ooms,
        "start_segments": len(segs),
        "start_blocks": len(blocks),
        "capacity": capacity,
        "capacity_inferred": inferred,
    }


def _retried_alloc(entries: list[dict], i: int) -> int | None:
    """The alloc a free-and-retry run starting at entry `i` made room for: the run is followed at once by a
    segment_alloc, whose alloc is the next one (None when the run is not followed by a segment_alloc)."""
    j = i
    while j < len(entries) and entries[j]["action"] == "segment_free":
        j += 1
    if j == len(entries) or entries[j]["action"] != "segment_alloc":
        return None
    return next((k for k in range(j + 1, len(entries)) if entries[k]["action"] == "alloc"), None)


def replay_snapshot(path: str | Path, config: AllocatorConfig | str | None = None,
                    capacity: int | None = None) -> dict:
    """Replay every device of a snapshot file; one dict per device under "devices", device 0's figures on top."""
    if isinstance(config, str) or config is None:
        config = AllocatorConfig.parse(config)
    snapshot = safe_loads(read_input(path, "trace", TRACE_FILE_LIMIT))
    n = max(len(snapshot.get("device_traces", []) if isinstance(snapshot, dict) else []), 1)
    devices = [replay_entries(snapshot, d, config, capacity) for d in range(n)]
    return {**devices[0], "devices": devices}
