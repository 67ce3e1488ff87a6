"""Export an event log: Chrome trace JSON (Perfetto, chrome://tracing) and a CUDA-snapshot pickle.

The snapshot export writes torch's own format (`segments`, `device_traces` with alloc /
free_requested / free_completed), so `torch/cuda/_memory_viz.py` renders a simulated run exactly like
a measured one. Addresses are synthetic (each block gets its own range in one segment per pool);
the block's category, name and op travel in `category` and `frames`. Files are written atomically.

Both show the events of the log: for a simulation whose later steps repeat simulated ones
(models/training.StepPlan) those are the simulated steps only; the Chrome trace says so in `otherData`
(`steps`, `steps_simulated`, `note`).
"""

from __future__ import annotations

import json
import pickle

from ..models.training import StepPlan
from ..simulator.events import Action, EventLog, Pool
from ..simulator.files import write_atomic

ALIGN = 512  # the CUDA caching allocator rounds blocks to 512 bytes; we only use it to space addresses


def chrome_trace(log: EventLog) -> dict:
    """Counter tracks (bytes live per category, per rank and pool) plus an instant event per alloc/free."""
    events = []
    running: dict[tuple, dict[str, int]] = {}
    for e in log.events:
        key = (e.block.rank, e.block.pool.value)
        counters = running.setdefault(key, {})
        counters[e.block.category.value] = counters.get(e.block.category.value, 0) + e.delta
        ts = e.time * 1e6
        pid = e.block.rank
        events.append({"name": f"{e.block.pool.value} memory (bytes)", "ph": "C", "ts": ts, "pid": pid,
                       "args": dict(sorted(counters.items()))})
        events.append({"name": f"{e.action.value} {e.block.name}", "ph": "i", "s": "t", "ts": ts, "pid": pid,
                       "tid": e.stream.value, "cat": e.block.category.value,
                       "args": {"bytes": e.block.nbytes, "op": e.op, "phase": e.phase.value, "step": e.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": log.source, **_steps_data(log)}}


def _steps_data(log: EventLog) -> dict:
    """What a truncated simulation's trace holds: the simulated steps, not every requested one."""
    plan = StepPlan.of(log.metadata)
    if not plan.truncated:
        return {}
    return {"steps": plan.steps, "steps_simulated": plan.simulated,
            "note": f"this trace shows the simulated steps only, of {plan.steps} steps: {plan.summary()}"}


def to_snapshot(log: EventLog) -> dict:
    """A dict in torch.cuda.memory._snapshot() format, one device trace per rank (device pools only:
    a CUDA snapshot has no host memory)."""
    device_events = [e for e in log.events if e.block.pool is Pool.DEVICE]
    ranks = sorted({e.block.rank for e in device_events}) or [0]
    traces: list[list[dict]] = [[] for _ in range(max(ranks) + 1)]
    addresses: dict[int, int] = {}
    next_addr = [ALIGN] * (max(ranks) + 1)
    live: dict[int, list[dict]] = {r: [] for r in range(max(ranks) + 1)}
    for e in device_events:
        b = e.block
        if b.id not in addresses:
            addresses[b.id] = next_addr[b.rank]
            next_addr[b.rank] += -(-max(b.nbytes, 1) // ALIGN) * ALIGN
        frames = [{"filename": e.op, "line": e.step, "name": b.name}]
        entry = {"addr": addresses[b.id], "size": b.nbytes, "stream": 0, "time_us": int(e.time * 1e6),
                 "frames": frames}
        if e.action is Action.ALLOC:
            traces[b.rank].append({"action": "alloc", **entry, "category": b.category.value})
        else:
            traces[b.rank].append({"action": "free_requested", **entry})
            traces[b.rank].append({"action": "free_completed", **entry})
    alive: dict[int, dict] = {}
    for e in device_events:
        if e.action is Action.ALLOC:
            alive[e.block.id] = e.block
        else:
            alive.pop(e.block.id, None)
    for b in alive.values():
        live[b.rank].append({"address": addresses[b.id], "size": b.nbytes, "requested_size": b.nbytes,
                             "state": "active_allocated", "frames": [{"filename": "", "line": 0, "name": b.name}]})
    segments = [{"device": r, "address": ALIGN, "total_size": next_addr[r] - ALIGN, "allocated_size":
                 sum(x["size"] for x in live[r]), "active_size": sum(x["size"] for x in live[r]),
                 "requested_size": sum(x["size"] for x in live[r]), "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": live[r]}
                for r in range(max(ranks) + 1)]
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}


def write_chrome_trace(log: EventLog, path: str) -> None:
    write_atomic(path, json.dumps(chrome_trace(log), separators=(",", ":")).encode())


def write_snapshot(log: EventLog, path: str) -> None:
    write_atomic(path, pickle.dumps(to_snapshot(log), protocol=4))
