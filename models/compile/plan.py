"""Inductor's memory plan of one compiled graph, read from its Python wrapper as it is generated.

Inductor lowers each partitioned graph (AOTAutograd's forward or backward) and writes a Python wrapper `call(args)`
whose memory lines are objects before they are text: `PythonWrapperCodegen.memory_plan_reuse` turns them into
`AllocateLine` (a buffer allocated: `empty_strided_cpu`), `FreeIfNotReusedLine` (a `del` unless the buffer was
handed on), `ReuseLine` (a buffer taken over by another name, no allocation), `ReinterpretLine` (a view of a buffer
under a new name), `FreeLine` (a `del` of a buffer or graph input), and, outside the planner, `ExternKernelAllocLine`
/ `MultiOutputLine` (a fallback kernel that allocates its own outputs, SDPA's for example). `capture_plans` wraps
that method for the duration of a compile and keeps, per graph, the lines in order as `Plan` events with each
buffer's bytes and dtype from inductor's IR; nothing is parsed from the text.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..trace.record import DTYPES


@dataclass
class Plan:
    """One graph's wrapper: its inputs (the placeholders, in `args` order), its outputs (a buffer or input name per
    returned value, None for a None), and its memory events in order:
    ("alloc", name, nbytes, dtype, shape), ("alias", new, old), ("drop", name)."""

    is_backward: bool
    inputs: list[str]
    outputs: list[str | None]
    events: list[tuple] = field(default_factory=list)
    peak_estimate: int | None = None  # inductor's own estimate of the graph's peak (memory.py)


def _int(graph, expr) -> int:
    return int(graph.sizevars.optimization_hint(expr, fallback=0))  # torch/_inductor/sizevars.py


def _alloc(graph, node) -> tuple:
    """("alloc", name, bytes, dtype, shape) of an IR buffer: its storage's size (a strided buffer's storage may
    exceed its shape) times its dtype's size."""
    dtype = node.get_dtype()
    shape = tuple(_int(graph, s) for s in node.get_size())
    try:  # torch/_inductor/graph.py GraphLowering.get_allocation_storage_size
        numel = _int(graph, graph.get_allocation_storage_size(node))
    except Exception:  # a layout without one: its shape's elements
        numel = 1
        for s in shape:
            numel *= s
    name = DTYPES.get(dtype, str(dtype).replace("torch.", ""))
    return ("alloc", node.get_name(), numel * dtype.itemsize, name, shape)


def _events(wrapper, graph) -> list[tuple]:
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as W

    out: list[tuple] = []
    for line in wrapper.lines:
        if isinstance(line, W.AllocateLine):
            out.append(_alloc(graph, line.node))
        elif isinstance(line, W.ReuseLine):
            out.append(("alias", line.reused_as.get_name(), line.node.get_name()))
            if line.delete_old:
                out.append(("drop", line.node.get_name()))
        elif isinstance(line, W.ReinterpretLine):
            out.append(("alias", line.reused_as.get_name(), line.node.get_name()))
        elif isinstance(line, W.FreeIfNotReusedLine):
            if not line.is_reused:
                out.append(("drop", line.node.get_name()))
        elif isinstance(line, W.FreeLine):
            out.append(("drop", line.node.get_name()))
        elif isinstance(line, W.ExternKernelAllocLine):  # a fallback kernel allocates its outputs itself
            if not isinstance(line.node.layout, ir.MultiOutputLayout):
                out.append(_alloc(graph, line.node))
        elif isinstance(line, W.MultiOutputLine):  # bufK = bufJ[i]: one output of a multi-output fallback
            out.append(_alloc(graph, graph.get_buffer(line.result_name)))
    return out


def _output_name(node) -> str | None:
    if node is None or not hasattr(node, "get_name"):
        return None
    try:
        return node.get_name()
    except Exception:  # a constant or a symbolic int returned
        return None


@contextlib.contextmanager
def capture_plans(plans: list[Plan]):
    """While active, every wrapper inductor generates appends its `Plan` to `plans`."""
    from torch._inductor.codegen import wrapper as W
    from torch._inductor.virtualized import V

    original = W.PythonWrapperCodegen.memory_plan_reuse

    def memory_plan_reuse(self):
        original(self)  # torch/_inductor/codegen/wrapper.py: the planner's lines, then ours read from them
        graph = V.graph
        estimate = getattr(getattr(self, "estimate_peak", None), "overall_peak_memory", None)
        plans.append(Plan(is_backward=bool(graph.is_backward), inputs=list(graph.graph_input_names),
                          outputs=[_output_name(o) for o in graph.graph_outputs], events=_events(self, graph),
                          peak_estimate=estimate))

    W.PythonWrapperCodegen.memory_plan_reuse = memory_plan_reuse
    try:
        yield plans
    finally:
        W.PythonWrapperCodegen.memory_plan_reuse = original


__all__ = ["Plan", "capture_plans"]
