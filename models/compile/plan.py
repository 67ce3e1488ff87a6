"""Inductor's memory plan of one compiled graph, read from its Python wrapper as it is generated.

Inductor lowers each partitioned graph (AOTAutograd's forward or backward) and writes a Python wrapper `call(args)`
whose memory lines are objects before they are text: `PythonWrapperCodegen.memory_plan_reuse` turns them into
`AllocateLine` (a buffer allocated: `empty_strided_cpu`), `FreeIfNotReusedLine` (a `del` unless the buffer was
handed on), `ReuseLine` (a buffer taken over by another name, no allocation), `ReinterpretLine` (a view of a buffer
under a new name), `FreeLine` (a `del` of a buffer or graph input), and, outside the planner, `ExternKernelAllocLine`
/ `MultiOutputLine` (a fallback kernel that allocates its own outputs, SDPA's for example). `capture_plans` wraps
that method for the duration of a compile and keeps, per graph, the lines in order as `Plan` events with each
buffer's bytes, dtype and strides from inductor's IR; nothing is parsed from the text.

What a line does not say, added from torch's behaviour: a multi-output fallback allocates all its outputs as it runs
(at the kernel's line, not at the later `bufK = bufJ[i]` lines), the ones the graph never reads included, which live
until the `del` of its result; oneDNN's channels-last convolution backward makes its weight gradient three times
(`_workspace`); an extern GEMM's own scratch memory (workspace.py, measured on this CPU by `workspaces`).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

from ..traced.record import DTYPES
from .workspace import signature


@dataclass
class Plan:
    """One graph's wrapper: its inputs (the placeholders, in `args` order), its outputs (a buffer or input name per
    returned value, None for a None), and its memory events in order:
    ("alloc", name, nbytes, dtype, shape, stride), ("alias", new, old), ("drop", name); and, until `workspaces`
    measures them, ("extern", name, signature): an extern GEMM whose own memory (workspace.py) is not known yet;
    after, ("gemm", name, flops) where it runs."""

    is_backward: bool
    inputs: list[str]
    outputs: list[str | None]
    events: list[tuple] = field(default_factory=list)
    peak_estimate: int | None = None  # inductor's own estimate of the graph's peak (memory.py)


def scratch(name: str, nbytes: int) -> list[tuple]:
    """A kernel's own block of `nbytes` (a scratchpad, a workspace), allocated and freed at its line."""
    return [scratch_alloc(name, nbytes), ("drop", name)]


def scratch_alloc(name: str, nbytes: int) -> tuple:
    """The allocation of a `scratch` block; its bytes a marker (negative) while workspace.py measures them."""
    return ("alloc", name, nbytes, "int8", (nbytes,), None)


def marker_of(ev: tuple) -> int | None:
    """The marker a `scratch_alloc` event holds in place of its bytes (workspace.py `deferred`), or None."""
    if ev[0] == "alloc" and ev[3] == "int8" and isinstance(ev[2], int) and ev[2] < 0:
        return ev[2]
    return None


def _int(graph, expr) -> int:
    return int(graph.sizevars.optimization_hint(expr, fallback=0))  # torch/_inductor/sizevars.py


def _alloc(graph, node) -> tuple:
    """("alloc", name, bytes, dtype, shape, stride) of an IR buffer: what `empty_strided(shape, stride)` allocates,
    1 + sum((size - 1) x stride) elements (aten's computeStorageNbytes: a padded layout's last row is not padded;
    int64[4, 2049] with row stride 2056: 65,928 B, as the H200 snapshot has it), times its dtype's size; a layout
    without strides: inductor's storage size (graph.py `get_allocation_storage_size`); its strides, or None."""
    dtype = node.get_dtype()
    shape = tuple(_int(graph, s) for s in node.get_size())
    try:
        stride = tuple(_int(graph, s) for s in node.get_stride())
    except Exception:  # a layout without strides
        stride = None
    if stride is not None and len(stride) == len(shape):
        numel = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    else:
        try:  # torch/_inductor/graph.py GraphLowering.get_allocation_storage_size
            numel = _int(graph, graph.get_allocation_storage_size(node))
        except Exception:  # a layout without one: its shape's elements
            numel = 1
            for s in shape:
                numel *= s
    name = DTYPES.get(dtype, str(dtype).replace("torch.", ""))
    return ("alloc", node.get_name(), numel * dtype.itemsize, name, shape, stride)


def _events(wrapper, graph) -> list[tuple]:
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as W

    out: list[tuple] = []
    made: set[str] = set()  # multi-output fallbacks' outputs, allocated as the kernel returns them
    unread: dict[str, list[str]] = {}  # a multi-output fallback -> its outputs the graph never reads
    for line in wrapper.lines:
        if isinstance(line, str):
            out.extend(_text_line(line))
        elif isinstance(line, W.AllocateLine):
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
        elif isinstance(line, W.ExternKernelOutLine):  # a GEMM into a planned buffer: its own memory, measured later
            sig = signature(line.node)
            if sig is not None:
                out.append(("extern", line.node.get_name(), sig))
        elif isinstance(line, W.ExternKernelAllocLine):  # a fallback kernel allocates its outputs itself
            if not isinstance(line.node.layout, ir.MultiOutputLayout):
                out.append(_alloc(graph, line.node))
                continue
            children = _outputs_of(graph, line.node)
            for child in children:
                out.append(_alloc(graph, child))
                made.add(child.get_name())
            removed = set(graph.removed_buffers)
            unread[line.node.get_name()] = [c.get_name() for c in children if c.get_name() in removed]
            out.extend(_workspace(graph, line.node, children))
        elif isinstance(line, W.MultiOutputLine):  # bufK = bufJ[i]: one output of a multi-output fallback
            if line.result_name not in made:
                out.append(_alloc(graph, graph.get_buffer(line.result_name)))
    for i in range(len(out) - 1, -1, -1):  # the outputs nobody reads go with the kernel's result (its `del`)
        if out[i][0] == "drop" and out[i][1] in unread:
            out[i + 1:i + 1] = [("drop", c) for c in unread.pop(out[i][1])]
    return out


# A mix-order reduction's last step (torch/_inductor/codegen/simd.py, CUDA): an eager reduce of the split kernel's
# workspace written as a plain line, `bufN = workspace_k[...].view(nsplit, rnumel).sum(dim=0)[.to(torch.bf16)]`,
# which allocates bufN (fp32, then its cast) with no AllocateLine (the wrapper only marks it allocated).
_MIX_ORDER = re.compile(r"^(buf\d+) = (workspace_\d+)\[.*\]\.view\((\d+), (\d+)\)\.\w+\(dim=0\)"
                        r"(?:\.to\(torch\.(\w+)\))?")


def _text_line(line: str) -> list[tuple]:
    """The memory events of a wrapper line inductor wrote as text: a mix-order reduction's eager reduce."""
    import torch

    m = _MIX_ORDER.match(line.strip())
    if not m:
        return []
    name, rnumel, cast = m.group(1), int(m.group(4)), m.group(5)
    if not cast:
        return [("alloc", name, rnumel * 4, "fp32", (rnumel,), (1,))]
    dtype = getattr(torch, cast)
    return [("alloc", f"{name}.fp32", rnumel * 4, "fp32", (rnumel,), (1,)),
            ("alloc", name, rnumel * dtype.itemsize, DTYPES.get(dtype, cast), (rnumel,), (1,)),
            ("drop", f"{name}.fp32")]


def _outputs_of(graph, node) -> list:
    """The tensors a multi-output fallback kernel returns, as inductor's IR names them (`FallbackKernel.create`
    makes a `MultiOutput` of each, read or not; DCE removes the unread ones from the program, not from the kernel's
    result), unless the op's schema says an output aliases an input (no allocation)."""
    from torch._inductor import ir

    schema = getattr(getattr(node, "op_overload", None), "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return []
    return [b for b in graph.buffers if isinstance(b, ir.MultiOutput) and b.inputs and b.inputs[0] is node
            and len(b.indices) == 1]


def _workspace(graph, node, children: list) -> list[tuple]:
    """A fallback kernel's own temporaries, alive while it runs, where they are known: oneDNN's convolution
    backward for channels-last tensors makes the weight gradient three times, oneDNN's result, its dense copy and
    that copy in channels-last, the kernel's output (aten/src/ATen/native/mkldnn/Conv.cpp
    `mkldnn_convolution_backward_weights`: `mkldnn_to_dense(...).to(at::MemoryFormat::ChannelsLast)`; measured on
    this CPU: 3 weight-sized blocks at once, the first two freed before it returns). cuDNN's attention backward
    (CUDA) takes one workspace of 4 B H T (D + 1) + 256 bytes after its dq, dk, dv and frees it before it returns
    (dq's shape B x H x T x D; an fp32 dq accumulator and softmax sums: measured on the H200 snapshots,
    68,157,696 B at B 4, H 32, T 2048, D 64 and 29,819,136 B at B 8, H 14, T 1024, D 64; bench/
    COMPILE_GPU_FINDINGS.md)."""
    import torch

    op = getattr(node, "op_overload", None)
    if op is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default and children:
        shape = _alloc(graph, children[0])[4]
        if len(shape) == 4:
            b, h, t, d = shape
            nbytes = 4 * b * h * t * (d + 1) + 256
            return scratch(f"{node.get_name()}.workspace", nbytes)
        return []
    if op is not torch.ops.aten.convolution_backward.default:
        return []
    weight = [c for c in children if c.indices and c.indices[0][1] == 1]
    if not weight or weight[0].get_device() is None or weight[0].get_device().type != "cpu":
        return []
    alloc = _alloc(graph, weight[0])
    shape, stride = alloc[4], alloc[5]
    if stride is None or len(shape) != 4 or stride[1] != 1 or shape[1] == 1:
        return []  # not channels-last: the path not measured here
    name = f"{node.get_name()}.workspace"
    return [("alloc", name, 2 * alloc[2], alloc[3], (2, *shape), None), ("drop", name)]


def workspaces(plans: list[Plan], threads: int | None) -> None:
    """Each extern GEMM's line as ("gemm", name, its FLOPs), then, for the CPU program (`threads` given), its own
    memory (workspace.py `measure`, on this CPU) as a block allocated and freed there, where it takes any. A CUDA
    GEMM's own memory is cuBLAS's workspace, one per handle and stream, which the replay adds (models/gpu.py)."""
    from .workspace import gemm_flops, measure

    for plan in plans:
        events = []
        for ev in plan.events:
            if ev[0] != "extern":
                events.append(ev)
                continue
            events.append(("gemm", ev[1], gemm_flops(ev[2])))
            nbytes = measure(ev[2], threads) if threads is not None else 0
            if nbytes:
                events += scratch(f"{ev[1]}.workspace", nbytes)
        plan.events = events


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


__all__ = ["Plan", "capture_plans", "workspaces", "scratch", "scratch_alloc", "marker_of"]
