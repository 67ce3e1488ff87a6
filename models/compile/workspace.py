"""The memory an extern GEMM of inductor's CPU program takes for itself while it runs, measured on this CPU.

Inductor calls aten's GEMMs as extern kernels writing into a buffer its plan allocated (`extern_kernels.mm(a, b,
out=buf)`: an `ExternKernelOutLine`), so the plan sees their output and nothing else. A GEMM that aten hands to
oneDNN (16-bit floating point on this CPU: aten/src/ATen/native/LinearAlgebra.cpp `addmm_impl_cpu_` ->
`use_mkldnn_matmul` -> aten/src/ATen/native/mkldnn/Matmul.cpp `mkldnn_matmul`) runs oneDNN's matmul primitive with a
user scratchpad (ideep: `attr.set_scratchpad_mode(dnnl::scratchpad_mode::user)`, the scratchpad a tensor of
`pd.scratchpad_desc()` allocated through torch's CPU allocator for the call and freed as it returns), and `bmm` makes
contiguous copies of inputs whose strides oneDNN does not take (`aten::contiguous` inside `aten::bmm`). The
scratchpad's size is oneDNN's choice for this CPU's instruction set (brgemm blocking: measured 25,600 B for a
64x64x192 bf16 `addmm`, 1,721,472 B for K = 8192, nothing for fp32, which MKL/BLAS runs without torch's allocator),
so it is measured here, once per GEMM signature (op, every tensor's size, strides and dtype, constants), by running
the op on zero tensors of those layouts under torch.profiler at the real run's thread count: the most bytes alive
at once inside the call. Every GEMM is measured with its M and N (the output's dimensions) cut to `CUT`, where
oneDNN's blocking stops growing with them (measured: 2048, 4096 and 8192 give the same scratchpad; below 2048 it
differs, so smaller ones are kept; K is kept whole: the scratchpad is not monotonic in it, 1,721,472 B for K = 4096
or 8192 and 197,632 B for K = 14336, M = N = 2048). oneDNN is warmed up once per process on a small GEMM of its own
(what its first call sets up is not a GEMM's); after that a GEMM's first call allocates what its later ones do
(measured), so each signature runs once. A probe costs 2 M N K multiply-adds of the cut shape: ~1 s for K = 14336.
"""

from __future__ import annotations

GEMMS = ("aten::mm.out", "aten::addmm.out", "aten::bmm.out", "aten::baddbmm.out")
CUT = 2048
_MEASURED: dict[tuple, int] = {}
_WARM: set[int] = set()  # thread counts oneDNN was warmed up at


def signature(node) -> tuple | None:
    """(op, ((size, stride, dtype) of each input and last the output), constants, kwargs) of an inductor
    `ExternKernelOut` GEMM, or None for another kernel or a symbolic layout."""
    op = getattr(node, "op_overload", None)
    name = getattr(op, "name", lambda: "")()
    if name not in GEMMS:
        return None
    try:
        layouts = []
        for x in [*node.inputs, node]:
            layout = x.get_layout()
            layouts.append((tuple(int(s) for s in layout.size), tuple(int(s) for s in layout.stride),
                            str(layout.dtype)))
        constants = tuple(node.constant_args)
        kwargs = tuple(sorted(node.kwargs.items()))
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return None
    if not all(isinstance(v, (int, float, bool)) for v in [*constants, *(v for _, v in kwargs)]):
        return None
    return name, tuple(layouts), constants, kwargs


def _zeros(size: tuple, stride: tuple, dtype):
    import torch

    numel = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    return torch.zeros(max(numel, 1), dtype=dtype).as_strided(size, stride)


def _cut(name: str, layouts: tuple) -> tuple:
    """The layouts with the output's M and N (last two dimensions) at most CUT, the inputs cut to match."""
    *ins, (osize, _, odtype) = layouts
    m, n = min(osize[-2], CUT), min(osize[-1], CUT)

    def dense(size):
        stride, acc = [], 1
        for s in reversed(size):
            stride.append(acc)
            acc *= s
        return tuple(reversed(stride))

    def transposed(stride):  # keep a transposed input transposed
        return len(stride) >= 2 and stride[-2] == 1 and stride[-1] != 1

    out = []
    for k, (size, stride, dtype) in enumerate(ins):
        size = list(size)
        if len(size) == 1:  # a bias along N
            size[-1] = min(size[-1], n) if size[-1] > 1 else size[-1]
        elif k == len(ins) - 2:  # mat1: M x K
            size[-2] = m
        else:  # mat2: K x N, or a bias (M x N)
            size[-1] = n
            if k == 0 and name in ("aten::addmm.out", "aten::baddbmm.out"):
                size[-2] = min(size[-2], m) if size[-2] > 1 else size[-2]
        new = dense(size)
        if transposed(stride):
            t = dense([*size[:-2], size[-1], size[-2]])
            new = (*t[:-2], t[-1], t[-2])
        if any(s == 0 for s in stride):  # a broadcast input stays broadcast
            new = tuple(0 if s == 0 else v for s, v in zip(stride, new))
        out.append((tuple(size), new, dtype))
    osize = (*osize[:-2], m, n)
    out.append((osize, dense(osize), odtype))
    return tuple(out)


def gemm_flops(sig: tuple) -> int:
    """The floating-point operations of the GEMM `sig`: 2 M N K per output matrix (torch/utils/flop_counter.py
    `mm_flop` / `bmm_flop`, which count a multiply-add as 2), the output's elements times 2 K."""
    *ins, (osize, _, _) = sig[1]
    numel = 1
    for n in osize:
        numel *= n
    return 2 * numel * ins[-2][0][-1]


def _warm_up(threads: int) -> None:
    import torch

    if threads not in _WARM:
        x = torch.zeros(64, 64, dtype=torch.bfloat16)
        torch.mm(x, x)
        _WARM.add(threads)


def measure(sig: tuple, threads: int) -> int:
    """The most bytes torch's CPU allocator holds at once inside one call of the GEMM `sig` (see the module
    docstring); 0 where it allocates nothing."""
    name, layouts, constants, kwargs = sig
    layouts = _cut(name, layouts)
    key = (name, layouts, constants, kwargs, threads)
    if key in _MEASURED:
        return _MEASURED[key]
    import torch
    from torch._C._profiler import _EventType
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile

    packet, overload = name.split("::", 1)[1].split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    before = torch.get_num_threads()
    peak = 0
    try:
        torch.set_num_threads(threads)
        with unset_fake_temporarily(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            tensors = [_zeros(size, stride, getattr(torch, dtype.replace("torch.", "")))
                       for size, stride, dtype in layouts]
            *ins, out = tensors
            _warm_up(threads)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                op(*ins, *constants, **dict(kwargs), out=out)
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
        live = 0
        for _, size in sorted(events):
            live += size
            peak = max(peak, live)
    finally:
        torch.set_num_threads(before)
    _MEASURED[key] = peak
    return peak


__all__ = ["signature", "measure", "gemm_flops", "GEMMS"]
