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
(measured), so each signature runs once. A probe costs 2 M N K multiply-adds of the cut shape, so K is cut too
where oneDNN's configuration shows the same scratchpad at a shorter K (onednn.py: a Llama-3 lm_head's backward,
K = 128256, is probed at K = 1280, ~0.06 s instead of ~8.5 s; elsewhere K is kept whole).

Which GEMMs are probed: those aten hands to oneDNN, 16-bit ones, and fp32 only where
`torch.set_float32_matmul_precision` lets oneDNN run it in bf32 / tf32 (aten/src/ATen/native/mkldnn/Matmul.cpp
`use_mkldnn_bf32_matmul`, `use_mkldnn_tf32_matmul`: precision "medium" / "high"); an fp32 GEMM at "highest"
(the default) runs in MKL/BLAS without torch's allocator and takes 0 B (measured: bench/compile_speed.py).

How probes overlap the compile: `signature` (called by plan.py as inductor writes each wrapper) hands every new
signature at once to one probing process of its own (`_Prober`, a new Python: nothing of the compiling process,
its fake tensors, threads or profiler, is shared), which measures them in order on the other core while the compile
goes on; `measure` takes the result, waiting for it where it is not in yet. The same call in the same fresh
state gives the same bytes wherever it runs (the worker warms oneDNN up as the compiling process would).

The disk cache: measured bytes are kept per machine in a JSON file (`cache_path`: $PEAKLEDGER_GEMM_CACHE, else
~/.cache/peakledger/gemm-scratchpad.json; "off" turns it off), written atomically, keyed by what the scratchpad
depends on: the CPU (model name and flags, /proc/cpuinfo), torch's version, oneDNN's version, the environment
variables that steer oneDNN's ISA and math mode, and the thread count, then the cut signature. A key not there is
measured.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

from ..config import ConfigError
from . import onednn
from .step import CPU_THREADS

GEMMS = ("aten::mm.out", "aten::addmm.out", "aten::bmm.out", "aten::baddbmm.out")
CUT = 2048
CACHE_ENV = "PEAKLEDGER_GEMM_CACHE"
_MEASURED: dict[tuple, int] = {}
_PENDING: dict[tuple, object] = {}  # key -> the `_Prober` asked to measure it, not answered yet
_POOL: list = []  # the probing process, once started
_DISK: dict = {}  # path -> {machine: {key: bytes}} as read, once per process
_WARM: set[int] = set()  # thread counts oneDNN was warmed up at (in the process that probes)
_DEFERRING: list = []  # non-empty while `deferred` is active
_MARKERS: list[tuple] = []  # (signature, threads) of each marker `measure` gave under `deferred`
_LOCAL: list = []  # non-empty in a process forked to compile: no probes from it (`markers_only`)


def signature(node) -> tuple | None:
    """(op, ((size, stride, dtype) of each input and last the output), constants, kwargs) of an inductor
    `ExternKernelOut` GEMM, or None for another kernel or a symbolic layout; one oneDNN runs starts being probed
    (`prefetch`)."""
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
    sig = name, tuple(layouts), constants, kwargs
    try:
        device = node.get_device().type
    except (AttributeError, NotImplementedError):
        device = None
    if device == "cpu":  # the CPU program's GEMMs are measured (plan.py `workspaces`), a CUDA one's not
        prefetch(sig, CPU_THREADS)
    return sig


def _zeros(size: tuple, stride: tuple, dtype):
    import torch

    numel = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    return torch.zeros(max(numel, 1), dtype=dtype).as_strided(size, stride)


def _cut(name: str, layouts: tuple) -> tuple:
    """The layouts with the output's M and N (last two dimensions) at most CUT, the inputs cut to match."""
    *ins, (osize, _, odtype) = layouts
    m, n = min(osize[-2], CUT), min(osize[-1], CUT)

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
        new = onednn.transposed_strides(size) if transposed(stride) else onednn.dense_strides(size)
        if any(s == 0 for s in stride):  # a broadcast input stays broadcast
            new = tuple(0 if s == 0 else v for s, v in zip(stride, new))
        out.append((tuple(size), new, dtype))
    osize = (*osize[:-2], m, n)
    out.append((osize, onednn.dense_strides(osize), odtype))
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


def probed(sig: tuple) -> bool:
    """Whether aten hands the GEMM `sig` to oneDNN, which takes a scratchpad through torch's allocator: a 16-bit
    input (aten/src/ATen/native/LinearAlgebra.cpp `addmm_impl_cpu_` -> `use_mkldnn_matmul`), or fp32 where the
    float32 matmul precision lets oneDNN run it as bf32 / tf32 (mkldnn/Matmul.cpp `use_mkldnn_bf32_matmul`,
    `use_mkldnn_tf32_matmul`); an fp32 GEMM at "highest" runs in MKL/BLAS (module docstring)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    dtypes = {dtype for _, _, dtype in sig[1]}
    if dtypes & {"torch.bfloat16", "torch.float16"}:
        return True
    return "torch.float32" in dtypes and torch.get_float32_matmul_precision() != "highest"


def _key(sig: tuple, threads: int) -> tuple:
    """What a probe runs for `sig`: M and N cut (`_cut`), and K where oneDNN's configuration shows the scratchpad
    the same at a shorter one (onednn.py)."""
    name, layouts, constants, kwargs = sig
    layouts = _cut(name, layouts)
    if onednn.applies(threads):
        layouts = onednn.k_cut(name, layouts)
    return name, layouts, constants, kwargs, threads


def cache_path() -> str | None:
    """The disk cache's file (module docstring), or None where $PEAKLEDGER_GEMM_CACHE is "off"."""
    path = os.environ.get(CACHE_ENV)
    if path == "off":
        return None
    return path or os.path.join(os.path.expanduser("~"), ".cache", "peakledger", "gemm-scratchpad.json")


@functools.cache
def machine() -> str:
    """What the scratchpad depends on besides the GEMM: the CPU's model name and flags, torch's and oneDNN's
    versions (the thread count is in each key); read once per process (every cache lookup asks)."""
    import hashlib

    import torch

    lines = onednn.cpuinfo()
    if lines is None:
        import platform
        cpu = platform.processor() or platform.machine()
    else:
        cpu = "\n".join(lines)
    steering = " ".join(f"{v}={os.environ.get(v, '')}" for v in onednn.STEERING)  # oneDNN's ISA and math mode
    text = f"{cpu}\ntorch {torch.__version__}\nonednn {' '.join(onednn.onednn_version())}\n{steering}"
    return hashlib.sha256(text.encode()).hexdigest()


def _disk() -> tuple[str | None, dict]:
    path = cache_path()
    if path is None:
        return None, {}
    if path not in _DISK:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        _DISK[path] = data if isinstance(data, dict) else {}
    return path, _DISK[path].setdefault(machine(), {})


def _remember(key: tuple, nbytes: int) -> None:
    _MEASURED[key] = nbytes
    path, known = _disk()
    if path is None or known.get(repr(key)) == nbytes:
        return
    known[repr(key)] = nbytes
    from ...simulator.safe_io import write_atomic

    try:  # another process's measurements written meanwhile are kept
        with open(path) as f:
            on_disk = json.load(f)
        on_disk = on_disk if isinstance(on_disk, dict) else {}
    except (OSError, ValueError):
        on_disk = {}
    mine = machine()
    on_disk[mine] = {**on_disk.get(mine, {}), **known}
    _DISK[path] = on_disk
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, json.dumps(on_disk, sort_keys=True, indent=0).encode(), staged=False)  # (a cache)
    except OSError:  # a read-only home: measured again next time
        pass


def _known(key: tuple) -> int | None:
    if key in _MEASURED:
        return _MEASURED[key]
    _, known = _disk()
    value = known.get(repr(key))
    if isinstance(value, int):
        _MEASURED[key] = value
        return value
    return None


class _Prober:
    """The probing process: `python -c` running `serve` (no main module of the caller's re-run), fed one key a
    line on its stdin, answering `repr(key)\tbytes` lines in the same order on its stdout."""

    def __init__(self) -> None:
        import subprocess
        import sys

        from ..traced.processes import own_processes

        code = "from peakledger.models.compile.workspace import serve; serve()"
        with own_processes():  # (started inside the traced step's user_code block: peakledger's, not the user's)
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.asked: list[str] = []
        self.answers: dict[str, int] = {}

    def ask(self, key: tuple) -> None:
        self.proc.stdin.write(repr(key) + "\n")
        self.proc.stdin.flush()
        self.asked.append(repr(key))

    def answer(self, key: tuple) -> int | None:
        want = repr(key)
        while want not in self.answers and self.asked:
            line = self.proc.stdout.readline()
            if not line:  # the process died (killed, out of memory): the caller measures in its own
                self.asked.clear()
                break
            asked, _, nbytes = line.rstrip("\n").rpartition("\t")
            self.answers[asked] = int(nbytes)
            if asked in self.asked:
                self.asked.remove(asked)
        return self.answers.pop(want, None)


def serve() -> None:
    """The probing process's loop (`_Prober`): measure each key read from stdin, in order."""
    import ast
    import sys

    for line in sys.stdin:
        key = ast.literal_eval(line)
        print(f"{line.rstrip()}\t{_probe(key)}", flush=True)


def prefetch(sig: tuple, threads: int) -> None:
    """Start probing `sig` in the probing process (module docstring), unless it is known or not oneDNN's."""
    if not probed(sig) or _LOCAL:
        return
    key = _key(sig, threads)
    if key in _PENDING or _known(key) is not None:
        return
    if not _POOL:
        try:
            _POOL.append(_Prober())
        except OSError:  # no process to be had: `measure` probes here
            return
    try:
        _POOL[0].ask(key)
    except OSError:  # the probing process is gone: `measure` probes here
        return
    _PENDING[key] = _POOL[0]


@contextlib.contextmanager
def deferred():
    """While active, `measure` answers a probed GEMM with a marker (a negative int, one per key) at once, its probe
    left running; `resolved` gives the bytes of a marker later. For captures that only feed a derivation
    (depth.py), whose compiles then need not wait for the probes."""
    _DEFERRING.append(True)
    try:
        yield
    finally:
        _DEFERRING.pop()


def marker(sig: tuple, threads: int) -> int:
    """The marker of a probed GEMM (a negative int, one per signature and thread count), its probe started."""
    prefetch(sig, threads)
    if (sig, threads) not in _MARKERS:
        _MARKERS.append((sig, threads))
    return -1 - _MARKERS.index((sig, threads))


def markers_only() -> None:
    """In a process forked to compile (depth.py): markers only, no probe started from it (the probing process and
    its pipes are the parent's), the markers it gives read back by the parent through `markers_given`."""
    _LOCAL.append(True)
    _POOL.clear()
    _PENDING.clear()


def markers_given() -> list[tuple]:
    """(signature, threads) of each marker given so far, by marker number (-1 - index)."""
    return list(_MARKERS)


def resolved(marker: int) -> int:
    """The bytes of a marker `measure` gave under `deferred` (waiting for its probe where it is not in yet); a
    number that is no marker, itself."""
    if marker >= 0:
        return marker
    sig, threads = _MARKERS[-marker - 1]
    deferring = list(_DEFERRING)
    _DEFERRING.clear()  # the bytes themselves, even within `deferred`
    try:
        return measure(sig, threads)
    finally:
        _DEFERRING.extend(deferring)


def measure(sig: tuple, threads: int) -> int:
    """The most bytes torch's CPU allocator holds at once inside one call of the GEMM `sig` (see the module
    docstring); 0 where it allocates nothing or oneDNN does not run it; under `deferred`, a marker."""
    if not probed(sig):
        return 0
    key = _key(sig, threads)
    if _DEFERRING:
        return marker(sig, threads)
    value = _known(key)
    if value is not None:
        return value
    prober = _PENDING.pop(key, None)
    value = prober.answer(key) if prober is not None else None
    if value is None:
        value = _probe(key)
    _remember(key, value)
    return value


def _probe(key: tuple) -> int:
    """One measured call of the (cut) GEMM `key` in this process."""
    name, layouts, constants, kwargs, threads = key
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
            dtypes = " and ".join(sorted({str(t.dtype).replace("torch.", "") for t in ins}))
            if " and " in dtypes:  # the real kernel refuses what the fake rule let through: the program fails
                raise ConfigError("module", f"aten.{packet} in the compiled program multiplies {dtypes} "
                                            "tensors, which torch refuses for real (mat1 and mat2 must have the same "
                                            "dtype): give the batch the parameters' dtype, or train under autocast "
                                            "(--precision bf16-autocast)")
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
    return peak


__all__ = ["signature", "measure", "prefetch", "probed", "deferred", "resolved", "gemm_flops", "cache_path", "machine",
           "GEMMS"]
