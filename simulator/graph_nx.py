"""The op graph in networkx's form: for graph tools (`simulate --export-graph FILE.graphml`) and for the step's
critical path.

`to_networkx` makes one node per op (its fields as attributes: name, rank, stream, phase, step, micro-batch index,
duration, FLOPs, bytes allocated, blocks freed) and one edge per dependency; the engine also runs each (rank, stream)
pair's ops one after another in graph order, so consecutive ops of a stream get an edge too (`kind` "stream"
beside "dependency"). The graph is then exactly the order the engine keeps, and `critical_path`, its longest path
weighted by each op's duration (networkx's `dag_longest_path`), is the chain of ops that sets when the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from .ops import Op, OpGraph
from .safe_io import write_atomic

END = "end"  # a sink every op leads to, so the last op's own duration counts


def to_networkx(graph: OpGraph) -> nx.DiGraph:
    g = nx.DiGraph()
    last: dict[tuple, int] = {}
    for op in graph.ops_in_order():
        g.add_node(op.id, name=op.name, rank=op.rank, stream=op.stream.value, phase=op.phase.value, step=op.step,
                   micro_batch_index=op.micro_batch_index, duration=op.duration, flops=op.flops,
                   alloc_bytes=sum(b.nbytes for b in op.allocs), frees=len(op.frees), recompute=op.recompute)
        for dep in graph.predecessors(op.id):
            g.add_edge(dep, op.id, kind="dependency")
        key = (op.rank, op.stream)
        if key in last and not g.has_edge(last[key], op.id):
            g.add_edge(last[key], op.id, kind="stream")
        last[key] = op.id
    return g


@dataclass(frozen=True)
class CriticalPath:
    ops: tuple[Op, ...]
    seconds: float  # the sum of their durations: when the run ends

    def by_stream(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for op in self.ops:
            out[op.stream.value] = out.get(op.stream.value, 0.0) + op.duration
        return out


def critical_path(graph: OpGraph) -> CriticalPath:
    """The longest chain of ops by duration through dependencies and stream order."""
    g = to_networkx(graph)
    for u, v, data in g.edges(data=True):  # an edge weighs what its source op takes
        data["w"] = g.nodes[u].get("duration", 0.0)
    g.add_edges_from([(n, END, {"w": g.nodes[n].get("duration", 0.0)}) for n in list(g.nodes)])
    path = [n for n in nx.dag_longest_path(g, weight="w") if n != END]
    ops = {op.id: op for op in graph.ops_in_order()}
    chain = tuple(ops[n] for n in path if n in ops)
    return CriticalPath(chain, sum(op.duration for op in chain))


def write_graphml(graph: OpGraph, path: str) -> None:
    """The op graph as GraphML (networkx's writer), written atomically."""
    lines = nx.generate_graphml(to_networkx(graph))
    write_atomic(path, ("\n".join(lines) + "\n").encode())
