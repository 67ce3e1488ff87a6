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

from .events import Block, Phase, Stream
from .run_metadata import RunMetadata


@dataclass(frozen=True)
class Op:
    id: int
    name: str
    stream: Stream
    phase: Phase
    step: int
    micro_batch_index: int
    duration: float
    rank: int = 0
    allocs: tuple[Block, ...] = ()
    frees: tuple[int, ...] = ()  # block ids
    flops: int = 0
    recompute: bool = False  # forward work repeated in backward (activation checkpointing)
    pool: Stream | None = None  # the stream whose allocator pool its blocks come from, when not its own: torch
    # allocates from the current stream's pool, and an op issued in program order may allocate under another
    # stream's context (`with torch.cuda.stream(s)`); its events carry that stream


def new_op(id: int, name: str, stream: Stream, phase: Phase, step: int, micro_batch_index: int, duration: float,
           rank: int, allocs: tuple[Block, ...], frees: tuple[int, ...], flops: int, recompute: bool,
           pool: Stream | None = None) -> Op:
    """`Op(...)`, equal to it field for field, made without the frozen dataclass's `__init__` (as
    events.new_block makes a block): a describer adds hundreds of thousands."""
    op = _new(Op)
    d = op.__dict__
    d["id"] = id
    d["name"] = name
    d["stream"] = stream
    d["phase"] = phase
    d["step"] = step
    d["micro_batch_index"] = micro_batch_index
    d["duration"] = duration
    d["rank"] = rank
    d["allocs"] = allocs
    d["frees"] = frees
    d["flops"] = flops
    d["recompute"] = recompute
    d["pool"] = pool
    return op


_new = object.__new__


class OpGraph:
    """Ops (node = op id) and their dependencies (edges), with a stable insertion order.

    Describers add ops with `add(op, after=...)` (and, for an edge to an op added earlier, `add_edge`); the
    simulator reads `ops_in_order()` and `predecessors`. Each op's predecessors are kept in the order their
    edges were added, each once. `metadata` (a RunMetadata) travels to the event log.
    """

    def __init__(self) -> None:
        self._order: list[Op] = []
        self._preds: dict[int, list[int]] = {}  # every node (an op, or an id an edge names) -> its predecessors
        self._topological: list[int] | None = None  # cached: `topological_order()` until the graph changes
        self.metadata = RunMetadata()

    def add(self, op: Op, after: tuple[int, ...] | list[int] = ()) -> Op:
        preds = self._preds
        if op.id in preds:
            raise ValueError(f"op id {op.id} added twice")
        deps = list(dict.fromkeys(after)) if len(after) > 1 else list(after)
        for dep in deps:
            if dep not in preds:
                preds[dep] = []  # an edge from an id not added (yet): a node without an op
        preds[op.id] = deps
        self._order.append(op)
        self._topological = None
        return op

    def extend(self, added: list[tuple[Op, list[int]]]) -> None:
        """`add` for each (op, its predecessors), where every predecessor is an op already in the graph, listed
        once, and the ops' ids are new (a describer's recorded pass played again: models/training.py `play`)."""
        preds, order = self._preds, self._order
        for op, deps in added:
            preds[op.id] = deps
            order.append(op)
        self._topological = None

    def add_edge(self, before: int, after: int) -> None:
        """`after` also waits for `before` (ids of ops, typically `before` added after `after`)."""
        preds = self._preds
        for node in (before, after):
            if node not in preds:
                preds[node] = []
        if before not in preds[after]:
            preds[after].append(before)
        self._topological = None

    def ops_in_order(self) -> list[Op]:
        return list(self._order)

    def predecessors(self, op_id: int) -> list[int]:
        return list(self._preds[op_id])

    def predecessor_lists(self) -> dict[int, list[int]]:
        """Every node's predecessors, the graph's own lists (read them, do not change them)."""
        return self._preds

    def __len__(self) -> int:
        return len(self._order)

    def topological_order(self) -> list[int]:
        """Every node, each after all of its predecessors (depth first over the predecessors, in insertion
        order: an insertion-ordered graph comes out as it is); shorter than the graph when it has a cycle."""
        if self._topological is None:
            preds = self._preds
            done: set[int] = set()
            out: list[int] = []
            for node, ps in preds.items():
                if node in done:
                    continue
                for d in ps:
                    if d not in done:
                        break
                else:  # every predecessor placed already: the usual case
                    done.add(node)
                    out.append(node)
                    continue
                if not self._place(node, done, out):
                    break
            self._topological = out
        return self._topological

    def _place(self, node: int, done: set[int], out: list[int]) -> bool:
        """Place `node` after its predecessors not placed yet (an explicit stack); False on a cycle."""
        preds = self._preds
        on_stack = {node}
        stack = [(node, iter(preds[node]))]
        while stack:
            n, it = stack[-1]
            for d in it:
                if d not in done:
                    if d in on_stack:
                        return False
                    on_stack.add(d)
                    stack.append((d, iter(preds[d])))
                    break
            else:
                stack.pop()
                on_stack.discard(n)
                done.add(n)
                out.append(n)
        return True

    def check(self) -> None:
        """No cycle; every freed block was allocated by an op that precedes the freeing op, exactly once."""
        if len(self.topological_order()) < len(self._preds):
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
