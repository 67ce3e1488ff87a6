"""The operation graph: what a describer hands the simulator.

An `Op` is one unit of work on one stream (a kernel, a fused layer step, a host copy). It allocates
its blocks when it starts and frees its blocks when it ends. Its duration comes from the cost model
(`Op.duration`, seconds). Dependencies are the graph's edges: an op starts only after every
predecessor has ended, and after the op before it on the same stream (streams run in order).

Same-instant rule: an op allocates its outputs and workspace at its start and frees its dead inputs
and workspace at its end; when several things happen at one instant, allocations of the op that
starts come after frees of the op that ends before it (the stream is sequential), but within one op
its allocations always come before its frees, so both count at that instant even for a zero-length
op. That is what the caching allocator sees: the output must exist before the input can go.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from .events import Block, Phase, Stream


@dataclass(frozen=True)
class Op:
    id: int
    name: str
    stream: Stream
    phase: Phase
    step: int
    micro_batch: int
    duration: float
    rank: int = 0
    allocs: tuple[Block, ...] = ()
    frees: tuple[int, ...] = ()  # block ids
    flops: int = 0
    recompute: bool = False  # forward work repeated in backward (activation checkpointing)


class OpGraph:
    """A networkx DiGraph of ops (node = op id, attribute `op`), with a stable insertion order.

    Describers add ops with `add(op, after=...)`; the simulator reads `ops_in_order()` and the edges.
    `blocks` holds every block any op allocates; `preexisting` are blocks live before the first op.
    """

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self._order: list[Op] = []
        self.metadata: dict = {}

    def add(self, op: Op, after: tuple[int, ...] | list[int] = ()) -> Op:
        if op.id in self.graph:
            raise ValueError(f"op id {op.id} added twice")
        self.graph.add_node(op.id, op=op)
        for dep in after:
            self.graph.add_edge(dep, op.id)
        self._order.append(op)
        return op

    def ops_in_order(self) -> list[Op]:
        return list(self._order)

    def predecessors(self, op_id: int) -> list[int]:
        return list(self.graph.predecessors(op_id))

    def __len__(self) -> int:
        return len(self._order)

    def check(self) -> None:
        """Every freed block was allocated by an op that precedes the freeing op, exactly once."""
        if not nx.is_directed_acyclic_graph(self.graph):
            raise ValueError("op graph has a cycle")
        allocated: set[int] = set()
        freed: set[int] = set()
        for op in self._order:
            for b in op.allocs:
                if b.id in allocated:
                    raise ValueError(f"block {b.id} ({b.name}) allocated twice")
                allocated.add(b.id)
            for bid in op.frees:
                if bid not in allocated:
                    raise ValueError(f"op {op.name} frees block {bid} that no earlier op allocated")
                if bid in freed:
                    raise ValueError(f"block {bid} freed twice")
                freed.add(bid)
