"""Record a whole training script on fake tensors: every storage it makes and frees, in program order, each at
the position (phase, step, micro-batch) the script is in, in the module it runs in.

The script runs as it is under torch's `FakeTensorMode` (shapes and dtypes, no memory), with the tracker's
technique (traces/tracker/): a `TorchDispatchMode` sees every aten op below autograd, a new output storage is
an allocation, `weakref.finalize` on the storage is its free; the tensors an op reads that were made outside
dispatch (`torch.tensor(data)` before its lift, a constant made at import) are allocated when first read, as the
tracker does. What the recording is not told it learns as the script goes (`ScriptPhases`): the models it calls,
the optimizers it steps; after each backward, optimizer step and zero_grad the `.grad`s and optimizer states are
labelled; a tensor autograd saves is an activation. Labels, strongest first: parameter, buffer, input (the
tensors a top-level module call is given), gradient, optimizer state, KV cache, accumulated eval outputs,
activation, temporary.

realpath.py keeps the fake run on the real path (kernel output sizes: kernel_outputs.py; transformers' tracing
test; the CPU kernels' fake rules); values.py answers the values the script reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import disable_fake_tensor_cache
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ...simulator.events import Category, OptimizerState
from ..traced.kernel_outputs import real_outputs
from ..traced.realpath import SCALAR_READS, tensors_in
from ..traced.record import DTYPES, op_flops, storage_lookup
from .phases import Calls, Position
from .values import REAL_DRAWS, Values

LABELS = (Category.PARAMETER, Category.BUFFER, Category.INPUT, Category.GRADIENT, Category.OPTIMIZER_STATE,
          Category.KV_CACHE, Category.PREDICTIONS, Category.ACTIVATION, Category.TEMPORARY)
_RANK = {c: k for k, c in enumerate(LABELS)}
# `torch.tensor(data)` makes a real tensor outside dispatch and lifts it: in the real run the lift returns that
# tensor (one storage, which the tracker finds when the lift reads it); here the fake output is that storage
LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}


@dataclass
class Stored:
    """One storage of the run (mutable while recording: its label can get stronger)."""

    id: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    name: str
    category: Category = Category.TEMPORARY
    label_name: str | None = None
    state: OptimizerState | None = None

    def label(self, category: Category, name: str | None = None, state: OptimizerState | None = None) -> None:
        if _RANK[category] < _RANK[self.category]:
            self.category = category
            self.label_name = name if name is not None else self.label_name
            self.state = state


@dataclass
class ScriptRecording:
    """What `Recorder` saw: `storages` by id; `events` in program order, each (action "alloc" | "free", storage
    id, the index of the aten call it happened in or after, the position, the name of the work); `flops` of each
    aten call that had any; what the script did (`calls`); the stand-in values given (`standins`); the storages
    alive at the end."""

    storages: dict[int, Stored]
    events: list[tuple[str, int, int, Position, str]]
    flops: dict[int, int]
    calls: Calls
    standins: list[str] = field(default_factory=list)
    live_at_end: list[int] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)  # the libraries the script ran, by name


class Recorder(TorchDispatchMode):
    """The dispatch side of a fake script run: storages, their births and deaths, values read. The position and
    the module come from `ScriptPhases` through `at` and `module`; `scan` and `inputs` label."""

    def __init__(self, values: Values, position: Position) -> None:
        super().__init__()
        self.values = values
        self.position = position
        self.module: str | None = None
        self.storages: dict[int, Stored] = {}
        self.live: dict[int, tuple[int, weakref.ref]] = {}  # id(storage object) -> (storage id, ref)
        self.events: list[tuple[str, int, int, Position, str]] = []
        self.flops: dict[int, int] = {}
        self.calls = 0  # aten calls seen
        self.op = "load"
        self.active = True
        self._finalizers: list[weakref.finalize] = []
        self._gone: set[int] = set()  # storages whose free is recorded

    # -- storages -----------------------------------------------------------------------------------------
    def see(self, t: torch.Tensor, name: str) -> int | None:
        """The storage id of `t`, recording its storage as allocated now if it is new."""
        st, known = storage_lookup(self.live, t)
        if st is None or known is not None:
            return known
        nbytes = st.nbytes()
        if nbytes == 0 or (st.device.type == "meta" and not _fake(t)):
            return None
        sid = len(self.storages) + 1
        self.storages[sid] = Stored(sid, nbytes, DTYPES.get(t.dtype, str(t.dtype).replace("torch.", "")),
                                    tuple(t.shape), name)
        self.live[id(st)] = (sid, weakref.ref(st))
        self._finalizers.append(weakref.finalize(st, self._freed, id(st), sid))
        self.events.append(("alloc", sid, self.calls, self.position, name))
        return sid

    def _freed(self, key: int, sid: int) -> None:
        if sid in self._gone:  # its storage was resized since: that allocation went then
            return
        hit = self.live.get(key)
        if hit is not None and hit[0] == sid:
            del self.live[key]
        self._gone.add(sid)
        if self.active:
            self.events.append(("free", sid, self.calls, self.position, self._name("free")))

    def resized(self, st, nbytes: int) -> None:
        """Storage `st` was resized (`UntypedStorage.resize_`: FSDP2 frees an unsharded parameter with a resize to
        0 and gathers it again with a resize back): its allocation goes, and a new one of `nbytes` (if any) takes its
        labels, as the tracker records it (traces/tracker/allocation.py `_StorageResizeWatch`)."""
        hit = self.live.get(id(st))
        old = self.storages[hit[0]] if hit is not None and hit[1]() is st else None
        if old is not None:
            del self.live[id(st)]
            self._gone.add(old.id)
            self.events.append(("free", old.id, self.calls, self.position, self._name("resize_")))
        if nbytes == 0:
            return
        sid = len(self.storages) + 1
        name = old.name if old is not None else self._name("resize_")
        new = Stored(sid, nbytes, old.dtype if old is not None else "int8",
                     old.shape if old is not None and old.nbytes == nbytes else (nbytes,), name)
        if old is not None:
            new.category, new.label_name, new.state = old.category, old.label_name, old.state
        self.storages[sid] = new
        self.live[id(st)] = (sid, weakref.ref(st))
        self._finalizers.append(weakref.finalize(st, self._freed, id(st), sid))
        self.events.append(("alloc", sid, self.calls, self.position, name))

    def label(self, t: torch.Tensor, category: Category, name: str | None = None,
              state: OptimizerState | None = None) -> None:
        for plain in plain_tensors(t):  # a DTensor's memory: its local shard
            sid = self.see(plain, name or self._name("mark"))
            if sid is not None:
                self.storages[sid].label(category, name, state)

    def _name(self, short: str) -> str:
        where = self.module or self.position.phase.value
        return f"{where}.{short}"

    # -- dispatch -------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        values = self.values
        real = values.shadows.inputs(func, args, kwargs)
        if func in SCALAR_READS:
            return values.read(func, args, kwargs, real)
        short = str(func).replace("aten.", "").replace(".default", "")
        self.calls += 1
        if func not in LIFTS:  # what was made outside dispatch is allocated when first read
            for t in _plain((args, kwargs)):
                self.see(t, self._name(f"untracked.{short}"))
        grown = _storage_sizes(args) if func in RESIZES else None
        known = values.shadows.known_shape(func, args, kwargs, real)
        if known is not None and known[0] == "out":
            out = known[1]
        else:
            call, call_args, call_kwargs = known[1:] if known is not None else (func, args, kwargs)
            if func in STORAGE_ARGS and args and _fake(args[0]):
                with disable_fake_tensor_cache(args[0].fake_mode):  # its cache key would hold the storage for good
                    result = call(*call_args, **(call_kwargs or {}))
            else:
                result = call(*call_args, **(call_kwargs or {}))
            out = real_outputs(func, args, kwargs, result)
            values.shadows.follow(func, args, kwargs, real, out)
        if func in REAL_DRAWS:
            values.draw(func, args, kwargs, out)
        values.assume(func, args, out)
        if grown is not None:  # `Tensor.resize_` that grows its storage reallocates it (the tracker sees a new pointer)
            for st, before in grown:
                if st.nbytes() > before:
                    self.resized(st, st.nbytes())
        flops = op_flops(func, args, kwargs, out)
        if flops:
            self.flops[self.calls] = flops
        outs = _plain(out)
        for k, t in enumerate(outs):
            self.see(t, self._name(short) + (f".out{k}" if k else ""))
        return out

    # -- labels ---------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks' pack: what autograd saves is an activation (same storage, detached: no cycle)."""
        for plain in plain_tensors(t):
            sid = storage_lookup(self.live, plain)[1]
            if sid is not None:
                self.storages[sid].label(Category.ACTIVATION)
        return t.detach()

    def inputs(self, tensors: list) -> None:
        for k, t in enumerate(tensors):
            self.label(t, Category.INPUT, f"batch.{k}")

    def scan(self, models: list, optimizers: list) -> None:
        """Label the models' parameters, buffers and `.grad`s and the optimizers' states (`label_state`)."""
        label_state(models, optimizers, self.label)

    def finish(self, calls: Calls, standins: list[str]) -> ScriptRecording:
        """Stop recording (later frees are not the run's) and hand over what was seen."""
        self.active = False
        live = sorted(sid for sid, ref in self.live.values() if ref() is not None)
        for f in self._finalizers:
            f.detach()
        return ScriptRecording(self.storages, self.events, self.flops, calls, standins, live)


RESIZES = {torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default}
# ops given a storage: the fake mode's dispatch cache keeps its arguments in the key, so a storage `torch.load` made
# (`empty().set_(storage, ...)`) would never be freed; they run without the cache
STORAGE_ARGS = {torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset}


def _storage_sizes(args) -> list:
    out = []
    for t in tensors_in(args):
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            continue
        out.append((st, st.nbytes()))
    return out


class resize_watch:
    """`torch.UntypedStorage.resize_` seen while recording (dispatch never sees a storage resize; FSDP2 frees and
    gathers every unsharded parameter so): a resize to 0 frees the storage's allocation, one that grows it
    reallocates it (`Recorder.resized`); a shrink keeps its memory, as the caching allocator does."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> "resize_watch":
        self.original = original = torch.UntypedStorage.resize_
        recorder = self.recorder

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            after = storage.nbytes()
            if after != before and (after == 0 or after > before):
                recorder.resized(storage, after)
            return result

        torch.UntypedStorage.resize_ = resize_
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self.original


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storages hold `t`'s memory: `t` itself, or the inner tensors of a wrapper
    subclass (a DTensor's memory is its local shard, `_local_tensor`; the wrapper has no storage)."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return [p for attr in inner if isinstance(getattr(t, attr), torch.Tensor)
                for p in plain_tensors(getattr(t, attr))]  # a DTensor also flattens its (opaque) device mesh
    return [t]


def _plain(tree) -> list[torch.Tensor]:
    return [p for t in tensors_in(tree) for p in plain_tensors(t)]


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def state_name(key: str) -> OptimizerState | None:
    """The `OptimizerState` an optimizer's state key names (None: a key the schema has no name for)."""
    try:
        return OptimizerState(key)
    except ValueError:
        return None


def label_state(models: list, optimizers: list, label: Callable) -> None:
    """Call `label(tensor, category, name, state)` for every parameter, buffer and `.grad` of `models` and every
    parameter, `.grad` and state tensor of `optimizers` (parameters only an optimizer holds keep its name
    "param"): the one walk the prediction (`Recorder.scan`) and the measurement (traces/script_run.py) label by."""
    names: dict[int, str] = {}
    for model in models:
        for n, p in model.named_parameters():
            names[id(p)] = n
            label(p, Category.PARAMETER, n, None)
            if p.grad is not None:
                label(p.grad, Category.GRADIENT, f"{n}.grad", None)
        for n, b in model.named_buffers():
            label(b, Category.BUFFER, n, None)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                n = names.get(id(p), "param")
                label(p, Category.PARAMETER, n, None)
                if p.grad is not None:
                    label(p.grad, Category.GRADIENT, f"{n}.grad", None)
        for p, state in opt.state.items():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    label(t, Category.OPTIMIZER_STATE, f"{names.get(id(p), 'param')}.{key}", state_name(key))
