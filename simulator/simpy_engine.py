"""The engine on SimPy's own objects (`--simulator simpy`, `Scenario.simulator`): the same event log as the built-in
engine (simulator/engine.py, which keeps SimPy's discipline without its objects, for speed), event for event, and a
`simpy.Environment` a user can add processes to.

Each (rank, stream) pair is one SimPy process that runs its ops in graph order. An op waits until every dependency
has ended, allocates its blocks from their pools, holds its stream for its duration, then frees its blocks. Pools
(device memory per rank, host memory per rank) have an optional capacity; the first allocation that exceeds it is
recorded as an `OOMRecord` with the live set at that exact event, and the run either stops there
(`stop_on_oom=True`, the log's metadata says `stopped_at_oom`) or continues to show how far over it goes.

Your own processes (`processes`): each is called with the `SimpySimulation` before the run (its `env`, its `pools`, the
log so far in `events`) and returns a generator SimPy runs beside the streams: a data loader that holds host memory
while it prefetches, a host-to-device link that delays what waits on it. They start after the streams, in the
order given. This is the engine as it ran up to commit 5a3656a, with the op contract's later `pool` stream;
tests/test_engine_simpy.py holds the two engines equal on graphs of every shape the describers make.

The graph's metadata travels to the log (with the steps it describes: models/training.StepPlan).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable

import simpy

from .events import Action, Block, Event, EventLog, OOMRecord
from .ops import Op, OpGraph
from .pools import MemoryPool, OutOfMemory, PoolKey, oom_record


class SimpySimulation:
    def __init__(self, graph: OpGraph, capacities: dict[PoolKey, int] | None = None,
                 stop_on_oom: bool = True, processes: Iterable[Callable[[SimpySimulation], Generator]] = ()) -> None:
        graph.check()
        self.graph = graph
        self.capacities = dict(capacities or {})
        self.stop_on_oom = stop_on_oom
        self.env = simpy.Environment()
        self.pools: dict[PoolKey, MemoryPool] = {}
        self.events: list[Event] = []
        self.ooms: list[OOMRecord] = []
        self.processes = tuple(processes)

    def _pool(self, block: Block) -> MemoryPool:
        key = (block.rank, block.pool)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = MemoryPool(capacity=self.capacities.get(key))
        return pool

    def _record(self, action: Action, block: Block, op: Op) -> Event:
        event = Event(seq=len(self.events), time=self.env.now, action=action, block=block,
                      phase=op.phase, step=op.step, micro_batch_index=op.micro_batch_index,
                      stream=op.pool or op.stream, op=op.name)
        self.events.append(event)
        return event

    def _alloc(self, block: Block, op: Op) -> None:
        pool = self._pool(block)
        event = self._record(Action.ALLOC, block, op)
        if pool.capacity is not None and not pool.oom_seen and pool.in_use + block.nbytes > pool.capacity:
            pool.oom_seen = True
            self.ooms.append(oom_record(pool, event))
            if self.stop_on_oom:
                self.events.pop()  # the allocation never happened; the OOM record keeps it
                raise OutOfMemory()
        pool.live[block.id] = block
        pool.in_use += block.nbytes

    def _free(self, block_id: int, op: Op, owner: dict[int, Block]) -> None:
        block = owner[block_id]
        pool = self._pool(block)
        del pool.live[block_id]
        pool.in_use -= block.nbytes
        self._record(Action.FREE, block, op)

    def run(self) -> EventLog:
        ops = self.graph.ops_in_order()
        done = {op.id: self.env.event() for op in ops}
        finished: set[int] = set()
        owner: dict[int, Block] = {}
        by_stream: dict[tuple[int, object], list[Op]] = {}
        for op in ops:
            by_stream.setdefault((op.rank, op.stream), []).append(op)

        def stream_process(stream_ops: list[Op]):
            for op in stream_ops:
                waits = [done[d] for d in self.graph.predecessors(op.id) if d not in finished]
                if waits:
                    yield self.env.all_of(waits)
                for b in op.allocs:
                    owner[b.id] = b
                    self._alloc(b, op)
                if op.duration > 0:
                    yield self.env.timeout(op.duration)
                for bid in op.frees:
                    self._free(bid, op, owner)
                finished.add(op.id)
                done[op.id].succeed()

        for key in sorted(by_stream, key=lambda k: (k[0], k[1].value)):
            self.env.process(stream_process(by_stream[key]))
        for make in self.processes:
            self.env.process(make(self))
        metadata = self.graph.metadata
        try:
            self.env.run()
        except OutOfMemory:
            # the log ends at the failed allocation, not at the last step
            metadata = metadata.updated(stopped_at_oom=True)
        return EventLog(events=self.events, source="simulator", metadata=metadata, ooms=self.ooms)


def simulate(graph: OpGraph, capacities: dict[PoolKey, int] | None = None, stop_on_oom: bool = True,
             processes: Iterable[Callable[[SimpySimulation], Generator]] = ()) -> EventLog:
    """Run the op graph on SimPy, with `processes` beside its streams; return the event log (with any OOM
    records)."""
    return SimpySimulation(graph, capacities, stop_on_oom, processes).run()
