"""A run as a Chrome trace (JSON Trace Event Format), for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per rank (`pid` = rank, named "rank N"), one thread per stream (`tid` 0 compute, 1 communication,
2 host, named so). On each stream's track, nested duration slices (`"ph": "X"`, microseconds):

- `step N` (cat "step"): a run of the stream's ops of one optimizer step (step 0: the load, before step 1);
- the phase (cat "phase"): load, forward, backward, optimizer, zero_grad, checkpoint save (Phase.CHECKPOINT),
  checkpoint load (the load phase's `checkpoint.load.*` ops), one slice per run of the stream's ops with the same
  step, phase and micro-batch (args: step, micro_batch_index);
- each op (cat "op"; "op,recompute" for forward work repeated in backward), args: phase, step, micro-batch.

Beside them: counter tracks of the bytes live per category (per rank and pool) and an instant event per
allocation and free (tid: the stream whose pool it is in).

When the slices come from the op graph (`chrome_trace(log, graph)`), every op has its slice and its times are the
engine's own: an op starts when the op before it on its stream and every op it depends on have ended, and ends
its duration later (simulator/engine.py), which is when the log records its allocations and frees. Without the
graph, the ops are read from the log: an op appears only if it allocates or frees, and its slice runs from its
first to its last memory event (an op that only allocates is a zero-length slice); `otherData.slices` says which.
A run stopped at an OOM shows the ops that started by then (an op still running is cut there).

The output is deterministic: the same run gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.training import StepPlan
from ..simulator.events import EventLog, Phase, Stream
from ..simulator.ops import OpGraph

TIDS = {Stream.COMPUTE: 0, Stream.COMMUNICATION: 1, Stream.HOST: 2}
FROM_GRAPH = "op graph: every op, at the engine's times"
FROM_LOG = ("event log: the ops that allocate or free, each from its first to its last memory event (ops without "
            "memory events are absent)")


@dataclass(frozen=True)
class Span:
    """One op's time on its stream."""

    rank: int
    stream: Stream
    name: str
    phase: Phase
    step: int
    micro_batch_index: int
    start: float  # seconds
    end: float
    recompute: bool = False
    cut: bool = False  # still running when the run stopped at an OOM


def phase_label(phase: Phase, op: str) -> str:
    """The phase slice's name: checkpoint saves and loads named so."""
    if phase is Phase.CHECKPOINT:
        return "checkpoint save"
    if phase is Phase.LOAD and op.startswith("checkpoint.load"):
        return "checkpoint load"
    return phase.value


def schedule(graph: OpGraph) -> dict[int, tuple[float, float]]:
    """{op id: (start, end)} as the engine runs the graph: an op starts when the op before it on its (rank, stream)
    and all its predecessors have ended (at time 0 when none), and ends `duration` later."""
    ops = graph.ops_in_order()
    by_id = {op.id: op for op in ops}
    preds = graph.predecessor_lists()
    before: dict[int, int] = {}
    last: dict[tuple, int] = {}
    for op in ops:
        key = (op.rank, op.stream)
        if key in last:
            before[op.id] = last[key]
        last[key] = op.id
    times: dict[int, tuple[float, float]] = {}
    for op in ops:
        stack = [op.id]
        while stack:  # depth first over the predecessors, without recursion (graphs of 10^5 ops and more)
            i = stack[-1]
            if i in times:
                stack.pop()
                continue
            deps = [d for d in preds.get(i, ()) if d in by_id] + ([before[i]] if i in before else [])
            waiting = [d for d in deps if d not in times]
            if waiting:
                stack.extend(waiting)
                continue
            start = max((times[d][1] for d in deps), default=0)
            times[i] = (start, start + by_id[i].duration)
            stack.pop()
    return times


def spans_from_graph(graph: OpGraph, log: EventLog) -> list[Span]:
    times = schedule(graph)
    stop = max((e.time for e in log.events), default=0) if log.metadata.stopped_at_oom else None
    out = []
    for op in graph.ops_in_order():
        start, end = times[op.id]
        if stop is not None and start > stop:
            continue
        cut = stop is not None and end > stop
        out.append(Span(op.rank, op.stream, op.name, op.phase, op.step, op.micro_batch_index, start,
                        stop if cut else end, op.recompute, cut))
    return out


def spans_from_log(log: EventLog) -> list[Span]:
    """The ops the log shows, by (rank, stream, step, phase, micro-batch, op), in order of first appearance."""
    found: dict[tuple, list[float]] = {}
    for e in log.events:
        key = (e.block.rank, e.stream, e.step, e.phase, e.micro_batch_index, e.op)
        times = found.get(key)
        if times is None:
            found[key] = [e.time, e.time]
        else:
            times[1] = e.time
    return [Span(rank, stream, op, phase, step, mb, t0, t1)
            for (rank, stream, step, phase, mb, op), (t0, t1) in found.items()]


def _us(seconds: float) -> float:
    return seconds * 1e6


def _slice(name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    ts, te = _us(start), _us(end)
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": te - ts, "pid": pid, "tid": tid, "args": args}


def slices(spans: list[Span]) -> list[dict]:
    """Step, phase and op slices, track by track: on each (rank, stream) the spans in order, grouped into runs of
    the same step, and of the same (step, phase, micro-batch), which nest by construction."""
    tracks: dict[tuple[int, Stream], list[Span]] = {}
    for s in spans:
        tracks.setdefault((s.rank, s.stream), []).append(s)
    out: list[dict] = []
    for (rank, stream), track in sorted(tracks.items(), key=lambda kv: (kv[0][0], TIDS[kv[0][1]])):
        track = sorted(track, key=lambda s: (s.start, s.end))  # stable: graph order among equal times
        tid = TIDS[stream]

        def runs(key):
            group: list[Span] = []
            for s in track:
                if group and key(s) != key(group[0]):
                    yield group
                    group = []
                group.append(s)
            if group:
                yield group

        for g in runs(lambda s: s.step):
            step = g[0].step
            out.append(_slice(f"step {step}" + (" (load)" if step == 0 else ""), "step", rank, tid, g[0].start,
                              max(s.end for s in g), {"step": step}))
        for g in runs(lambda s: (s.step, phase_label(s.phase, s.name), s.micro_batch_index)):
            s0 = g[0]
            out.append(_slice(phase_label(s0.phase, s0.name), "phase", rank, tid, s0.start, max(s.end for s in g),
                              {"step": s0.step, "micro_batch_index": s0.micro_batch_index, "ops": len(g)}))
        for s in track:
            args = {"phase": s.phase.value, "step": s.step, "micro_batch_index": s.micro_batch_index}
            if s.cut:
                args["cut_at_oom"] = True
            out.append(_slice(s.name, "op,recompute" if s.recompute else "op", rank, tid, s.start, s.end, args))
    level = {"step": 0, "phase": 1}
    out.sort(key=lambda x: (x["pid"], x["tid"], x["ts"], -x["dur"], level.get(x["cat"], 2)))
    return out


def _names(log: EventLog, spans: list[Span]) -> list[dict]:
    """process_name / thread_name metadata for every rank and stream used."""
    ranks = sorted({e.block.rank for e in log.events} | {s.rank for s in spans})
    streams = sorted({(e.block.rank, e.stream) for e in log.events} | {(s.rank, s.stream) for s in spans},
                     key=lambda x: (x[0], TIDS[x[1]]))
    out = []
    for r in ranks:
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for r, s in streams:
        out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": TIDS[s], "args": {"name": s.value}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": TIDS[s], "args": {"sort_index": TIDS[s]}})
    return out


def memory_events(log: EventLog) -> list[dict]:
    """Counter tracks (bytes live per category, per rank and pool) plus an instant event per alloc/free."""
    events = []
    running: dict[tuple, dict[str, int]] = {}
    for e in log.events:
        key = (e.block.rank, e.block.pool.value)
        counters = running.setdefault(key, {})
        counters[e.block.category.value] = counters.get(e.block.category.value, 0) + e.delta
        ts = _us(e.time)
        pid = e.block.rank
        events.append({"name": f"{e.block.pool.value} memory (bytes)", "ph": "C", "ts": ts, "pid": pid,
                       "args": dict(sorted(counters.items()))})
        events.append({"name": f"{e.action.value} {e.block.name}", "ph": "i", "s": "t", "ts": ts, "pid": pid,
                       "tid": TIDS[e.stream], "cat": e.block.category.value,
                       "args": {"bytes": e.block.nbytes, "op": e.op, "phase": e.phase.value, "step": e.step}})
    return events


def steps_data(log: EventLog) -> dict:
    """What a truncated simulation's trace holds: the simulated steps, not every requested one."""
    plan = StepPlan.of(log.metadata)
    if not plan.truncated:
        return {}
    return {"steps": plan.steps, "steps_simulated": plan.simulated,
            "note": f"this trace shows the simulated steps only, of {plan.steps} steps: {plan.summary()}"}


def chrome_trace(log: EventLog, graph: OpGraph | None = None) -> dict:
    """The trace (see the module docstring); `graph`: the op graph the log was simulated from, for every op's
    slice at the engine's times (without it, the ops the log shows)."""
    spans = spans_from_graph(graph, log) if graph is not None else spans_from_log(log)
    events = _names(log, spans) + slices(spans) + memory_events(log)
    other = {"source": log.source, "slices": FROM_GRAPH if graph is not None else FROM_LOG, **steps_data(log)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
