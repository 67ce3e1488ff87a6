"""The discrete-event engine: op graph in, exact allocate/free event log out.

Each (rank, stream) pair is one process that runs its ops in graph order. An op waits until every
dependency has ended, allocates its blocks from their pools, holds its stream for its duration, then frees
its blocks. Pools (device memory per rank, host memory per rank) have an optional capacity; the first
allocation that exceeds it is recorded as an `OOMRecord` with the live set at that exact event, and the run
either stops there (`stop_on_oom=True`, the log's metadata says `stopped_at_oom`) or continues to show how
far over it goes.

The scheduler is SimPy's discipline (simpy 4: `Environment.run` over processes, `Timeout`, `AllOf`), kept
step for step without its objects, so that the events come out in the order a SimPy run records them: one
queue ordered by (time, priority, the order things were scheduled); the processes start, in (rank, stream)
order, as urgent events at time 0; an op's duration is a timeout; an op that must wait for ops of other
streams waits on the condition "all of them ended", which is scheduled when the last of their end events is
processed and resumes the process when it is processed in turn. An op's end is scheduled only when a
condition waits for it (processing it does nothing else), and a process that hits a stopping OOM ends the
run when its failure, scheduled then, is processed.

The graph's metadata travels to the log (with the steps it describes: models/training.StepPlan).
"""

from __future__ import annotations

from heapq import heappop, heappush

from . import simpy_engine
from .events import Action, Block, Event, EventLog, OOMRecord
from .gcpause import paused_gc
from .ops import Op, OpGraph
from .pools import MemoryPool, OutOfMemory, PoolKey, oom_record

ALLOC, FREE = Action.ALLOC, Action.FREE
_new = object.__new__


URGENT, NORMAL = 0, 1  # SimPy's priorities: a process's start before anything else at the same time
_RESUME, _ENDED, _STOP = 0, 1, 2  # what a queue entry does: resume a process, end an op others wait for, stop


class Simulation:
    def __init__(self, graph: OpGraph, capacities: dict[PoolKey, int] | None = None,
                 stop_on_oom: bool = True) -> None:
        graph.check()
        self.graph = graph
        self.capacities = dict(capacities or {})
        self.stop_on_oom = stop_on_oom
        self.pools: dict[PoolKey, MemoryPool] = {key: MemoryPool(capacity=cap)
                                                 for key, cap in self.capacities.items() if cap is not None}
        self.events: list[Event] = []
        self.ooms: list[OOMRecord] = []

    def _start(self, op: Op, now: float, owner: dict[int, Block]) -> None:
        """`op`'s allocations, at `now`; the pools with a capacity (the only ones kept) checked first."""
        events, pools, new = self.events, self.pools, _new
        phase, step, mb, stream, name = op.phase, op.step, op.micro_batch_index, op.pool or op.stream, op.name
        for b in op.allocs:
            owner[b.id] = b
            e = new(Event)
            d = e.__dict__  # Event(...) field by field (simulator/events.py new_event), inline: the hot path
            d["seq"] = len(events)
            d["time"] = now
            d["action"] = ALLOC
            d["block"] = b
            d["phase"] = phase
            d["step"] = step
            d["micro_batch_index"] = mb
            d["stream"] = stream
            d["op"] = name
            events.append(e)
            if pools:
                pool = pools.get((b.rank, b.pool))
                if pool is not None:
                    if not pool.oom_seen and pool.in_use + b.nbytes > pool.capacity:
                        pool.oom_seen = True
                        self.ooms.append(oom_record(pool, e))
                        if self.stop_on_oom:
                            events.pop()  # the allocation never happened; the OOM record keeps it
                            raise OutOfMemory()
                    pool.live[b.id] = b
                    pool.in_use += b.nbytes

    def _end(self, op: Op, now: float, owner: dict[int, Block]) -> None:
        """`op`'s frees, at `now`."""
        events, pools, new = self.events, self.pools, _new
        phase, step, mb, stream, name = op.phase, op.step, op.micro_batch_index, op.pool or op.stream, op.name
        for bid in op.frees:
            b = owner[bid]
            if pools:
                pool = pools.get((b.rank, b.pool))
                if pool is not None:
                    del pool.live[bid]
                    pool.in_use -= b.nbytes
            e = new(Event)
            d = e.__dict__
            d["seq"] = len(events)
            d["time"] = now
            d["action"] = FREE
            d["block"] = b
            d["phase"] = phase
            d["step"] = step
            d["micro_batch_index"] = mb
            d["stream"] = stream
            d["op"] = name
            events.append(e)

    def run(self) -> EventLog:
        by_stream: dict[tuple[int, object], list[Op]] = {}
        for op in self.graph.ops_in_order():
            by_stream.setdefault((op.rank, op.stream), []).append(op)
        preds = self.graph.predecessor_lists()
        owner: dict[int, Block] = {}
        finished: set[int] = set()
        waiting: dict[int, list[list]] = {}  # op id -> the conditions [ops not ended yet, process] waiting for it
        # a process: [its ops, the index of the op it is at, 0 = before its wait, 1 = before its allocations,
        # 2 = before its frees]; the queue: (time, priority, order scheduled, what, process or op id); the clock starts
        # at the int 0, as SimPy's does (the events before the first timeout say time 0, not 0.0)
        queue = [(0, URGENT, n, _RESUME, [by_stream[key], 0, 0])
                 for n, key in enumerate(sorted(by_stream, key=lambda k: (k[0], k[1].value)))]  # a heap: sorted
        eid = len(queue)
        start, end = self._start, self._end
        checked, events, new = bool(self.pools), self.events, _new
        append = events.append
        metadata = self.graph.metadata
        while queue:
            now, _, _, what, target = heappop(queue)
            if what == _ENDED:
                for cond in waiting.pop(target):
                    cond[0] -= 1
                    if cond[0] == 0:  # all of them ended: the condition is scheduled, and resumes its process
                        heappush(queue, (now, NORMAL, eid, _RESUME, cond[1]))
                        eid += 1
                continue
            if what == _STOP:
                # the log ends at the failed allocation, not at the last step
                metadata = metadata.updated(stopped_at_oom=True)
                break
            ops, i, stage = target
            try:
                while i < len(ops):
                    op = ops[i]
                    if stage == 0:
                        waits = preds[op.id]
                        if not waits:
                            pass
                        elif len(waits) == 1:  # the usual case: the op before it on its stream, or one other
                            if waits[0] in finished:
                                waits = ()
                        else:
                            waits = [d for d in waits if d not in finished]
                        if waits:
                            cond = [len(waits), target]
                            for d in waits:
                                waiting.setdefault(d, []).append(cond)
                            target[1], target[2] = i, 1
                            break
                    if stage < 2:
                        if not op.allocs:
                            pass
                        elif checked:
                            start(op, now, owner)
                        else:  # no capacity to check: `_start` without the pools, inline (the hot path)
                            phase, step, mb, name = op.phase, op.step, op.micro_batch_index, op.name
                            stream = op.pool or op.stream
                            for b in op.allocs:
                                owner[b.id] = b
                                e = new(Event)
                                d = e.__dict__
                                d["seq"] = len(events)
                                d["time"] = now
                                d["action"] = ALLOC
                                d["block"] = b
                                d["phase"] = phase
                                d["step"] = step
                                d["micro_batch_index"] = mb
                                d["stream"] = stream
                                d["op"] = name
                                append(e)
                        if op.duration > 0:
                            heappush(queue, (now + op.duration, NORMAL, eid, _RESUME, target))
                            eid += 1
                            target[1], target[2] = i, 2
                            break
                    if not op.frees:
                        pass
                    elif checked:
                        end(op, now, owner)
                    else:  # `_end` without the pools, inline
                        phase, step, mb, name = op.phase, op.step, op.micro_batch_index, op.name
                        stream = op.pool or op.stream
                        for bid in op.frees:
                            e = new(Event)
                            d = e.__dict__
                            d["seq"] = len(events)
                            d["time"] = now
                            d["action"] = FREE
                            d["block"] = owner[bid]
                            d["phase"] = phase
                            d["step"] = step
                            d["micro_batch_index"] = mb
                            d["stream"] = stream
                            d["op"] = name
                            append(e)
                    finished.add(op.id)
                    if op.id in waiting:
                        heappush(queue, (now, NORMAL, eid, _ENDED, op.id))
                        eid += 1
                    i, stage = i + 1, 0
            except OutOfMemory:  # the process fails; the run stops when its failure is processed
                heappush(queue, (now, NORMAL, eid, _STOP, None))
                eid += 1
        return EventLog(events=self.events, source="simulator", metadata=metadata, ooms=self.ooms)


SIMULATORS = ("builtin", "simpy")  # this module's engine; simpy_engine.py's, on SimPy's own objects


def simulate(graph: OpGraph, capacities: dict[PoolKey, int] | None = None,
             stop_on_oom: bool = True, simulator: str = "builtin") -> EventLog:
    """Run the op graph; return the event log (with any OOM records). `simulator` "simpy" runs it on SimPy's
    objects (simpy_engine.py): the same log, slower, open to processes of your own."""
    if simulator == "simpy":
        return simpy_engine.simulate(graph, capacities, stop_on_oom)
    if simulator != "builtin":
        raise ValueError(f"simulator {simulator!r}; allowed: {', '.join(SIMULATORS)}")
    with paused_gc():
        return Simulation(graph, capacities, stop_on_oom).run()
