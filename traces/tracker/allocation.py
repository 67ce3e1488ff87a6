"""`AllocationTracker`: every storage allocated and freed while it is active, recorded as `Event`s of our schema,
each allocation one `_Record` labelled by precedence until the log is built. Its parts: `_Mode` (the
TorchDispatchMode that sees every aten op below autograd), `_StorageResizeWatch` (`UntypedStorage.resize_` patched
while tracking) and the tracker itself (recording, labels, context, the resulting `EventLog`). How it measures and
labels: the package's docstring (traces/tracker/__init__.py)."""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...models.script.record import plain_tensors, state_name
from ...simulator.events import Action, Block, Category, Event, EventLog, OptimizerState, Phase, Pool, Stream
from ...simulator.run_metadata import RunMetadata
from ..fsdp_labels import FSDPLabels

SOURCE = "torch-dispatch-tracker"

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64",
               torch.int32: "int32", torch.bool: "bool", torch.int8: "int8", torch.uint8: "int8",
               torch.float64: "fp64", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}

_PRECEDENCE = [Category.PARAMETER, Category.BUFFER, Category.INPUT, Category.GRADIENT, Category.OPTIMIZER_STATE,
               Category.ALL_GATHER_BUFFER, Category.REDUCE_SCATTER_BUCKET, Category.CHECKPOINT_STAGING,
               Category.KV_CACHE, Category.PREDICTIONS, Category.ACTIVATION, Category.TEMPORARY]
RESIZE_OP = "UntypedStorage.resize_"


@dataclass
class _Record:
    """One allocation while it is being tracked; turned into a frozen `Block` at the end."""

    id: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    name: str
    labels: set = field(default_factory=set)
    state: OptimizerState | None = None
    label_name: str | None = None  # the name that goes with the strongest label (param / grad / state)
    label_rank: int = len(_PRECEDENCE)
    shard_factor: int = 1
    pool: Pool = Pool.DEVICE
    freed: bool = False

    def label(self, category: Category, name: str | None = None, state: OptimizerState | None = None) -> None:
        self.labels.add(category)
        rank = _PRECEDENCE.index(category)
        if rank < self.label_rank:
            self.label_rank = rank
            if name is not None:
                self.label_name = name
            if state is not None:
                self.state = state

    @property
    def category(self) -> Category:
        return _PRECEDENCE[self.label_rank] if self.label_rank < len(_PRECEDENCE) else Category.TEMPORARY

    def inherit(self, previous: "_Record") -> None:
        """Take the labels of the allocation this one replaces in the same storage (a storage resized to 0
        and back: FSDP2's unsharded parameters)."""
        self.labels = set(previous.labels)
        self.label_rank, self.label_name = previous.label_rank, previous.label_name
        self.state, self.shard_factor = previous.state, previous.shard_factor


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


def shard_factor(t: torch.Tensor) -> int:
    """How many ranks one full tensor is split across: the product of the mesh sizes of a DTensor's `Shard`
    placements; 1 for a plain tensor."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return 1
    mesh = t.device_mesh
    factor = 1
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            factor *= mesh.size(dim)
    return factor


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: "AllocationTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tr = self.tracker
        inputs: dict[int, tuple] = {}  # data_ptr before the op -> (storage, a tensor on it)
        for t in tensors_in((args, kwargs)):
            st = _storage(t)
            if st is None:
                continue
            inputs[st.data_ptr()] = (st, t)
            if tr.discover_inputs:
                tr._see(st, t, f"untracked:{func}")
        tr._op = str(func)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            tr._op = None
        for key, (st, t) in inputs.items():
            if st.data_ptr() != key:  # the op reallocated an input's storage (aten.resize_, an out= argument)
                tr._resized(st, key, str(func), t)
        if tr.ddp_buckets and func.namespace == "c10d" and "allreduce" in func.name():
            tr._label_ddp_buckets(tensors_in((args, kwargs)))
        for t in tensors_in(out):
            st = _storage(t)
            if st is not None and st.data_ptr() not in inputs:
                tr._see(st, t, str(func))
        return out


def tensors_in(tree) -> list[torch.Tensor]:
    """The plain tensors of every tensor in `tree` (a pytree: an op's args, its output), a DTensor's local shard."""
    return [p for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor) for p in plain_tensors(a)]


class _StorageResizeWatch:
    """`torch.UntypedStorage.resize_` patched while tracking: dispatch never sees a storage resize, yet
    FSDP2 frees and re-allocates every unsharded parameter that way (`resize_(0)`, then `resize_(n)`).
    Each resize frees the storage's current allocation and records a new one of the new size."""

    def __init__(self, tracker: "AllocationTracker") -> None:
        self.tracker = tracker
        self.original = None

    def __enter__(self) -> None:
        self.original = torch.UntypedStorage.resize_
        original, tracker = self.original, self.tracker

        def resize_(storage, size):
            key = storage.data_ptr()
            result = original(storage, size)
            if storage.data_ptr() != key or storage.nbytes() == 0:
                tracker._resized(storage, key, RESIZE_OP)
            return result

        torch.UntypedStorage.resize_ = resize_

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self.original


class AllocationTracker:
    """Record every storage allocated and freed while active, as `Event`s in our schema.

    Use as a context manager; set the loop position with `phase(...)`; call `scan()` after backward,
    optimizer step and zero_grad so gradients and optimizer states are labelled; `log()` at the end.
    `rank` is written on every Block (one tracker per process of a distributed run). A model with FSDP2
    units (`fully_shard`) gets its communication buffers and unsharded parameters labelled too (see
    `FSDPLabels`). `ddp_buckets=True` (a DistributedDataParallel run; build the DDP wrapper inside the
    tracker, so its buckets are seen being allocated) labels every storage a c10d all-reduce reads
    as `ddp.bucket.<k>` (REDUCE_SCATTER_BUCKET: the schema's gradient-communication bucket), k counting
    the distinct buckets in the order the step all-reduces them (bucket 0 holds the last parameters).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 saved_tensor_hooks: bool = True, discover_inputs: bool = True, known: tuple = (),
                 rank: int = 0, ddp_buckets: bool = False) -> None:
        self.model = model
        self.rank = rank
        self.ddp_buckets = ddp_buckets
        self._buckets_per_step: dict[int, list[int]] = {}  # step -> record ids of the buckets all-reduced
        self.optimizer = optimizer
        self.saved_tensor_hooks = saved_tensor_hooks
        self.discover_inputs = discover_inputs
        self.records: dict[int, _Record] = {}
        self.live: dict[int, tuple[_Record, weakref.ref]] = {}  # storage data_ptr -> record
        self.raw: list[tuple] = []  # (time, action, record id, phase, step, micro_batch, op)
        self.phase_state: tuple[Phase, int, int] = (Phase.LOAD, 0, -1)
        self.module_stack: list[str] = []
        self._op: str | None = None
        self._active = False
        self._t0 = 0.0
        self._hooks: list = []
        self._finalizers: list[weakref.finalize] = []
        self._known = known  # tensors alive before the run that are not to be counted (e.g. the host batch)
        self._ignored: set[int] = set()
        self._stack: contextlib.ExitStack | None = None
        self.param_names: dict[int, str] = {}
        self._replaced: dict[int, tuple[weakref.ref, _Record]] = {}  # id(storage) -> its allocation resized away
        self._fsdp: FSDPLabels | None = None

    # -- recording ----------------------------------------------------------------------------------
    def _name_for(self, op: str) -> str:
        phase = self.phase_state[0]
        short = op.replace("aten.", "").replace(".default", "")
        if phase is Phase.BACKWARD:
            node = torch._C._current_autograd_node()
            if node is not None:
                return f"{node.name()}.{short}"
        if self.module_stack:
            return f"{self.module_stack[-1]}.{short}"
        return f"{phase.value}.{short}"

    def _see(self, st, t: torch.Tensor | None, op: str, name: str | None = None) -> _Record | None:
        """The record of storage `st`, recording it as allocated now if it is new. `t` (a tensor on `st`)
        gives dtype and shape; without one (a storage resize) they come from the allocation it replaces,
        whose labels a re-allocation of the same storage always inherits."""
        if not self._active:
            return None
        if st.device.type == "meta":  # meta tensors hold shapes, not memory
            return None
        key = st.data_ptr()
        nbytes = st.nbytes()
        if nbytes == 0 or key in self._ignored:
            return None
        hit = self.live.get(key)
        if hit is not None and hit[1]() is st:
            return hit[0]
        previous = self._replaced_record(st)
        if t is not None:
            dtype, shape = DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)
        elif previous is not None:
            dtype, shape = previous.dtype, previous.shape if previous.nbytes == nbytes else (nbytes,)
        else:
            dtype, shape = "int8", (nbytes,)
        rec = _Record(id=len(self.records) + 1, nbytes=nbytes, dtype=dtype, shape=shape,
                      name=name or (previous.name if previous is not None else self._name_for(op)))
        if previous is not None:
            rec.inherit(previous)
        self.records[rec.id] = rec
        self.live[key] = (rec, weakref.ref(st))
        self._event(Action.ALLOC, rec, op)
        self._finalizers.append(weakref.finalize(st, self._freed, key, rec.id))
        return rec

    def _freed(self, key: int, rid: int) -> None:
        hit = self.live.get(key)
        if hit is not None and hit[0].id == rid:
            del self.live[key]
        self._free(self.records[rid], self._op or "release")

    def _free(self, rec: _Record, op: str) -> None:
        if self._active and not rec.freed:
            rec.freed = True
            self._event(Action.FREE, rec, op)

    def _resized(self, st, old_key: int, op: str, t: torch.Tensor | None = None) -> None:
        """Storage `st` was reallocated in place (its data pointer moved from `old_key`, or it shrank to 0
        bytes): free its old allocation, record the new one (shaped as `t`, if given) with its labels."""
        if not self._active:
            return
        hit = self.live.get(old_key)
        if hit is not None and hit[1]() is st:
            del self.live[old_key]
            self._free(hit[0], op)
            self._replaced[id(st)] = (weakref.ref(st), hit[0])
        if st.nbytes():
            self._see(st, t, op)

    def _label_ddp_buckets(self, tensors: list[torch.Tensor]) -> None:
        step = self.phase_state[1]
        seen = self._buckets_per_step.setdefault(step, [])
        for t in tensors:
            rec = self.record_of(t)
            if rec is None:
                continue
            if rec.id not in seen:
                seen.append(rec.id)
            name = f"ddp.bucket.{seen.index(rec.id)}"
            if rec.label_rank > _PRECEDENCE.index(Category.REDUCE_SCATTER_BUCKET):
                rec.label(Category.REDUCE_SCATTER_BUCKET, name)

    def _replaced_record(self, st) -> _Record | None:
        hit = self._replaced.get(id(st))
        return hit[1] if hit is not None and hit[0]() is st else None

    def _event(self, action: Action, rec: _Record, op: str) -> None:
        phase, step, mb = self.phase_state
        self.raw.append((time.perf_counter() - self._t0, action, rec.id, phase, step, mb, op))

    def record_of(self, t: torch.Tensor) -> _Record | None:
        """The live record of `t`'s storage (a DTensor's: its local shard's), or None."""
        st = _storage(plain_tensors(t)[0])
        if st is None:
            return None
        hit = self.live.get(st.data_ptr())
        return hit[0] if hit is not None and hit[1]() is st else None

    def mark(self, t: torch.Tensor, category: Category, name: str | None = None,
             state: OptimizerState | None = None, pool: Pool | None = None) -> _Record | None:
        """Label the storage of `t` (recording it now if it was never seen); a DTensor's local shard, with
        the DTensor's shard factor; `pool` says it is host memory. Returns the record (None for 0 bytes)."""
        rec = None
        for plain in plain_tensors(t):
            rec = self.record_of(plain)
            if rec is None:
                st = _storage(plain)
                if st is None:
                    continue
                rec = self._see(st, plain, "mark", name=name)
                if rec is None:
                    continue
            rec.label(category, name, state)
            rec.shard_factor = max(rec.shard_factor, shard_factor(t))
            if pool is not None:
                rec.pool = pool
        return rec

    def mark_input(self, *tensors: torch.Tensor) -> None:
        for i, t in enumerate(tensors):
            self.mark(t, Category.INPUT, name=f"batch.{i}")

    def scan(self) -> None:
        """Label the current `.grad`s and optimizer states (call after backward / step / zero_grad)."""
        if self.model is not None:
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    rec = self.record_of(p.grad)
                    bucket = rec is not None and Category.REDUCE_SCATTER_BUCKET in rec.labels
                    # FSDP2: one reduce-scatter output holds the unit's sharded grads; it keeps its name
                    self.mark(p.grad, Category.GRADIENT, name=rec.label_name if bucket else f"{n}.grad")
        if self.optimizer is not None:
            # an optimizer-state offload (traces/reference/build.py StateOffload) names its host buffers: host memory
            for (pid, k), t in getattr(self.optimizer, "host_buffers", {}).items():
                self.mark(t, Category.OPTIMIZER_STATE, name=f"{self.param_names.get(pid, 'param')}.{k}.host",
                          state=state_name(k), pool=Pool.HOST)
            for p, state in self.optimizer.state.items():
                pname = self.param_names.get(id(p), "param")
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        self.mark(v, Category.OPTIMIZER_STATE, name=f"{pname}.{k}", state=state_name(k))

    # -- context --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, phase: Phase, step: int = 0, micro_batch: int = -1):
        previous = self.phase_state
        self.phase_state = (phase, step, micro_batch)
        try:
            yield self
        finally:
            self.phase_state = previous

    @contextlib.contextmanager
    def scope(self, name: str):
        """Name what is allocated inside `<name>.<op>` (e.g. a wrapper's own work: "ddp.init")."""
        self.module_stack.append(name)
        try:
            yield self
        finally:
            self.module_stack.pop()

    def name_module(self, module: torch.nn.Module, name: str) -> None:
        """Name what `module`'s forward allocates outside its submodules `<name>.<op>` (a wrapper such as
        DistributedDataParallel around the tracked model); the hooks go when tracking stops."""
        self._hooks.append(module.register_forward_pre_hook(self._pre_hook(name)))
        self._hooks.append(module.register_forward_hook(self._post_hook()))

    def _pack(self, t: torch.Tensor):
        rec = self.record_of(t)
        if rec is not None:
            rec.label(Category.ACTIVATION)
        return t.detach()  # same storage; no grad_fn, so no reference cycle through the saving node

    def __enter__(self) -> "AllocationTracker":
        self._t0 = time.perf_counter()
        self._active = True
        for t in self._known:
            st = _storage(t)
            if st is not None:
                self._ignored.add(st.data_ptr())
        with self.phase(Phase.LOAD, 0, -1):
            if self.model is not None:
                self.param_names = {id(p): n for n, p in self.model.named_parameters()}
                for n, p in self.model.named_parameters():
                    self.mark(p, Category.PARAMETER, name=n)
                for n, b in self.model.named_buffers():
                    self.mark(b, Category.BUFFER, name=n)
                for name, mod in self.model.named_modules():
                    self._hooks.append(mod.register_forward_pre_hook(self._pre_hook(name or "model")))
                    self._hooks.append(mod.register_forward_hook(self._post_hook()))
            self.scan()
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_post_hook"):
            # states that live only inside step() (an offload's device copies) are labelled right after it
            self._hooks.append(self.optimizer.register_step_post_hook(lambda *_: self.scan()))
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_StorageResizeWatch(self))
        if self.model is not None and FSDPLabels.applies_to(self.model):
            self._fsdp = self._stack.enter_context(FSDPLabels(self, self.model))
        if self.saved_tensor_hooks:
            self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x))
        self._stack.enter_context(_Mode(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self.scan()
        self._active = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre_hook(self, name: str):
        def hook(module, args):
            self.module_stack.append(name)
            if self._fsdp is not None:
                self._fsdp.label_unsharded(module)  # runs after FSDP's own pre-forward (prepended) gathered
        return hook

    def _post_hook(self):
        def hook(module, args, output):
            if self.module_stack:
                self.module_stack.pop()
        return hook

    # -- result ---------------------------------------------------------------------------------------
    def log(self, metadata: RunMetadata | None = None) -> EventLog:
        """The events so far as an `EventLog`, labels fixed up, with `metadata` over the tracker's own (its
        `live_at_end` lists the block ids never freed: still alive when tracking stopped)."""
        blocks = {}
        for rec in self.records.values():
            blocks[rec.id] = Block(id=rec.id, nbytes=rec.nbytes, category=rec.category,
                                   name=rec.label_name or rec.name, dtype=rec.dtype, shape=rec.shape,
                                   state=rec.state if rec.category is Category.OPTIMIZER_STATE else None,
                                   shard_factor=rec.shard_factor, rank=self.rank, pool=rec.pool)
        events = [Event(seq=i, time=t, action=a, block=blocks[rid], phase=ph, step=s, micro_batch_index=mb,
                        stream=Stream.COMPUTE, op=op)
                  for i, (t, a, rid, ph, s, mb, op) in enumerate(self.raw)]
        live = sorted(r.id for r in self.records.values() if not r.freed)
        meta = RunMetadata(live_at_end=live, device="cpu", torch=torch.__version__).updated(metadata)
        return EventLog(events=events, source=SOURCE, metadata=meta)
