"""An exact allocation tracker for real torch runs, writing our event schema (`EventLog`).

How it measures
---------------
- A `TorchDispatchMode` sees every aten op below autograd (forward, backward and optimizer kernels).
  Each output tensor's untyped storage that is not already known, and is not the storage of one of
  the op's inputs, is a new allocation of `storage.nbytes()` bytes. Views and in-place results share
  a known storage and allocate nothing. Zero-byte storages are ignored.
- `weakref.finalize` on that storage fires when its last reference (Python or C++) goes; that is the
  free. Storage Python objects are preserved by torch while the C++ storage lives, so the finalizer
  does not fire early.
- A tensor an op reads whose storage was never seen (created outside dispatch, e.g. the tensor
  `torch.tensor(0.0)` builds before its `lift_fresh`) is recorded as allocated when first seen.
  Python scalars wrapped by the arg parser never reach dispatch: that is the tiny gap to the profiler.
- Everything alive before the run is recorded at the start, in Phase.LOAD: parameters (PARAMETER),
  module buffers (BUFFER), existing `.grad`s (GRADIENT) and optimizer state (OPTIMIZER_STATE).

Labels
------
Each allocation is one internal, mutable record; Blocks and Events are built at the end, so labels
known only later are fixed up before the log is returned:
PARAMETER > BUFFER > INPUT (tensors passed to `mark_input`) > GRADIENT (a storage that was some
parameter's `.grad`, checked after every backward, optimizer step and zero_grad; a temporary the
AccumulateGrad node stole becomes the gradient) > OPTIMIZER_STATE (a storage found in
`optimizer.state`, with its `OptimizerState`) > ACTIVATION (saved for backward, learnt through
`torch.autograd.graph.saved_tensors_hooks`, or explicitly `mark`ed: `run_training_steps` marks the
logits/outputs the caller holds until backward ends, as the simulator counts them) > TEMPORARY.
The phase, step and micro-batch come from `with tracker.phase(...)`; names are the module path
(forward pre/post hooks) plus the aten op in forward, the running autograd node in backward, and
`param.grad` / `param.exp_avg` ... for gradients and optimizer state.

Exactness (measured on this machine, torch 2.13 CPU, `torch.set_num_threads(1)`, seed 0), the 3 x
Linear(512) MLP ("tiny-mlp"), batch 64, AdamW, 2 steps, `run_training_steps` vs `profiler_peak` (the
same loop under torch.profiler, memory-timeline peak event by event, host batch excluded):

    foreach   tracker 15,759,384 B   profiler 15,759,396 B   gap 12 B
    for-loop  tracker 14,706,712 B   profiler 14,706,724 B   gap 12 B
    fused     tracker 13,262,876 B   profiler 13,262,876 B   gap 0

The 12 B are tiny scalar allocations dispatch never sees, the same gap as in the shared notes. The
notes' absolute figures (15,099,932 B for-loop, 16,152,604 B foreach) are both 393,220 B = 3 x
131,072 + 4 higher, which is what one (64, 512) fp32 inputs + targets + output and the 4-byte loss
still alive at the optimizer step would add (the notes do not give their loop, so this is an
inference); this loop drops them when backward ends, as the simulator's loop does.
Running the tracker with or without the saved-tensor hooks gives the same peak (the pack hook returns
a detached alias of the same storage, so it creates no reference cycle through the saving node).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..simulator.events import Action, Block, Category, Event, EventLog, OptimizerState, Phase, Pool, Stream

SOURCE = "torch-dispatch-tracker"

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64",
               torch.int32: "int32", torch.bool: "bool", torch.int8: "int8", torch.uint8: "int8",
               torch.float64: "fp64"}

_PRECEDENCE = [Category.PARAMETER, Category.BUFFER, Category.INPUT, Category.GRADIENT, Category.OPTIMIZER_STATE,
               Category.ACTIVATION, Category.TEMPORARY]


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


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: "AllocationTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tr = self.tracker
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        input_keys = set()
        for t in inputs:
            st = _storage(t)
            if st is None:
                continue
            input_keys.add(st.data_ptr())
            if tr.discover_inputs:
                tr._see(st, t, f"untracked:{func}")
        tr._op = str(func)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            tr._op = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None and st.data_ptr() not in input_keys:
                    tr._see(st, t, str(func))
        return out


class AllocationTracker:
    """Record every storage allocated and freed while active, as `Event`s in our schema.

    Use as a context manager; set the loop position with `phase(...)`; call `scan()` after backward,
    optimizer step and zero_grad so gradients and optimizer states are labelled; `log()` at the end.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 saved_tensor_hooks: bool = True, discover_inputs: bool = True, known: tuple = ()) -> None:
        self.model = model
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

    def _see(self, st, t: torch.Tensor, op: str, name: str | None = None) -> _Record | None:
        if not self._active:
            return None
        key = st.data_ptr()
        nbytes = st.nbytes()
        if nbytes == 0 or key in self._ignored:
            return None
        hit = self.live.get(key)
        if hit is not None and hit[1]() is st:
            return hit[0]
        rec = _Record(id=len(self.records) + 1, nbytes=nbytes, dtype=DTYPE_NAMES.get(t.dtype, str(t.dtype)),
                      shape=tuple(t.shape), name=name or self._name_for(op))
        self.records[rec.id] = rec
        self.live[key] = (rec, weakref.ref(st))
        self._event(Action.ALLOC, rec, op)
        self._finalizers.append(weakref.finalize(st, self._freed, key, rec.id))
        return rec

    def _freed(self, key: int, rid: int) -> None:
        hit = self.live.get(key)
        if hit is not None and hit[0].id == rid:
            del self.live[key]
        rec = self.records[rid]
        if self._active and not rec.freed:
            rec.freed = True
            self._event(Action.FREE, rec, self._op or "release")

    def _event(self, action: Action, rec: _Record, op: str) -> None:
        phase, step, mb = self.phase_state
        self.raw.append((time.perf_counter() - self._t0, action, rec.id, phase, step, mb, op))

    def record_of(self, t: torch.Tensor) -> _Record | None:
        st = _storage(t)
        if st is None:
            return None
        hit = self.live.get(st.data_ptr())
        return hit[0] if hit is not None and hit[1]() is st else None

    def mark(self, t: torch.Tensor, category: Category, name: str | None = None,
             state: OptimizerState | None = None) -> None:
        """Label the storage of `t` (recording it now if it was never seen)."""
        rec = self.record_of(t)
        if rec is None:
            st = _storage(t)
            if st is None:
                return
            rec = self._see(st, t, "mark", name=name)
            if rec is None:
                return
        rec.label(category, name, state)

    def mark_input(self, *tensors: torch.Tensor) -> None:
        for i, t in enumerate(tensors):
            self.mark(t, Category.INPUT, name=f"batch.{i}")

    def scan(self) -> None:
        """Label the current `.grad`s and optimizer states (call after backward / step / zero_grad)."""
        if self.model is not None:
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    self.mark(p.grad, Category.GRADIENT, name=f"{n}.grad")
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                pname = self.param_names.get(id(p), "param")
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        try:
                            st = OptimizerState(k)
                        except ValueError:
                            st = None
                        self.mark(v, Category.OPTIMIZER_STATE, name=f"{pname}.{k}", state=st)

    # -- context --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, phase: Phase, step: int = 0, micro_batch: int = -1):
        previous = self.phase_state
        self.phase_state = (phase, step, micro_batch)
        try:
            yield self
        finally:
            self.phase_state = previous

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
        self._stack = contextlib.ExitStack()
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
        return hook

    def _post_hook(self):
        def hook(module, args, output):
            if self.module_stack:
                self.module_stack.pop()
        return hook

    # -- result ---------------------------------------------------------------------------------------
    def log(self, metadata: dict | None = None) -> EventLog:
        """The events so far as an `EventLog`, labels fixed up; `metadata["live_at_end"]` lists the block
        ids never freed (still alive when tracking stopped)."""
        blocks = {}
        for rec in self.records.values():
            blocks[rec.id] = Block(id=rec.id, nbytes=rec.nbytes, category=rec.category,
                                   name=rec.label_name or rec.name, dtype=rec.dtype, shape=rec.shape,
                                   state=rec.state if rec.category is Category.OPTIMIZER_STATE else None,
                                   pool=Pool.DEVICE)
        events = [Event(seq=i, time=t, action=a, block=blocks[rid], phase=ph, step=s, micro_batch=mb,
                        stream=Stream.COMPUTE, op=op)
                  for i, (t, a, rid, ph, s, mb, op) in enumerate(self.raw)]
        live = sorted(r.id for r in self.records.values() if not r.freed)
        meta = {"live_at_end": live, "device": "cpu", "torch": torch.__version__}
        meta.update(metadata or {})
        return EventLog(events=events, source=SOURCE, metadata=meta)


def _batch_for(batches, step: int, mb: int, grad_accum: int):
    return batches[((step - 1) * grad_accum + mb) % len(batches)]


def run_training_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                       grad_accum: int = 1, set_to_none: bool = True, seed: int = 0,
                       saved_tensor_hooks: bool = True, metadata: dict | None = None,
                       autocast: torch.dtype | None = None) -> EventLog:
    """Run a real CPU training loop under the tracker and return its `EventLog`.

    The loop is models/training.py's: parameters already loaded (recorded at LOAD), then for each step
    `grad_accum` x (copy the micro-batch in: INPUT; `out, loss = model(x, y)`; `loss.backward()`; drop
    out, loss and the batch copy, still in BACKWARD), `optimizer.step()` (OPTIMIZER),
    `optimizer.zero_grad(set_to_none)` (ZERO_GRAD). `batches` are (inputs, targets) pairs, used in turn.
    `torch.set_num_threads(1)` and a fixed seed make the bytes reproducible. `autocast` (e.g.
    torch.bfloat16) runs the forward and the loss under `torch.autocast("cpu", dtype=autocast)`;
    backward runs outside it, as usual (the autocast weight-cast cache is cleared when the forward ends).
    """
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    known = tuple(t for b in batches for t in b)
    tracker = AllocationTracker(model, optimizer, saved_tensor_hooks=saved_tensor_hooks, known=known)
    with tracker:
        for step in range(1, steps + 1):
            for mb in range(grad_accum):
                with tracker.phase(Phase.FORWARD, step, mb):
                    x, y = (t.clone() for t in _batch_for(batches, step, mb, grad_accum))
                    tracker.mark_input(x, y)
                    with (torch.autocast("cpu", dtype=autocast) if autocast is not None
                          else contextlib.nullcontext()):
                        out, loss = model(x, y)
                    tracker.mark(out, Category.ACTIVATION)  # held by the caller until backward ends
                with tracker.phase(Phase.BACKWARD, step, mb):
                    loss.backward()
                    del out, loss, x, y
                    tracker.scan()
            with tracker.phase(Phase.OPTIMIZER, step):
                optimizer.step()
                tracker.scan()
            with tracker.phase(Phase.ZERO_GRAD, step):
                optimizer.zero_grad(set_to_none=set_to_none)
                tracker.scan()
    meta = {"steps": steps, "grad_accum": grad_accum, "set_to_none": set_to_none,
            "optimizer": type(optimizer).__name__, "autocast": None if autocast is None else str(autocast)}
    meta.update(metadata or {})
    return tracker.log(meta)


def profiler_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                  grad_accum: int = 1, set_to_none: bool = True, seed: int = 0) -> int:
    """The same loop under `torch.profiler` (profile_memory=True): the memory timeline's peak bytes on CPU,
    event by event, pre-existing tensors included except the host-side `batches` themselves (the tracker
    does not count them either: it counts the per-micro-batch copies, as the simulator does)."""
    from torch.profiler._memory_profiler import Action as PAction

    from .profiler import profiled_memory  # imports this module: import here, not at the top

    timeline = profiled_memory(model, optimizer, batches, steps, grad_accum, set_to_none, seed).timeline
    cpu = torch.device("cpu")
    host_batch = {t.untyped_storage().data_ptr() for b in batches for t in b}
    running = peak = 0
    for _t, action, (key, _version), nbytes in timeline:
        if key.device != cpu or (action == PAction.PREEXISTING and key.storage.ptr in host_batch):
            continue
        if action in (PAction.PREEXISTING, PAction.CREATE):
            running += nbytes
        elif action == PAction.DESTROY:
            running -= nbytes
        peak = max(peak, running)
    return peak


def live_bytes(log: EventLog, upto: int | None = None) -> dict[Category, int]:
    """Bytes live by category right after event index `upto` (the whole log by default)."""
    out: dict[Category, int] = {}
    for e in log.events[: None if upto is None else upto + 1]:
        out[e.block.category] = out.get(e.block.category, 0) + e.delta
    return {c: b for c, b in out.items() if b}


def peak(log: EventLog) -> tuple[int, int]:
    """(peak bytes, index of the event right after which it is first reached)."""
    running, best, best_i = 0, -1, -1
    for i, e in enumerate(log.events):
        running += e.delta
        if running > best:
            best, best_i = running, i
    return best, best_i


__all__ = ["AllocationTracker", "run_training_steps", "profiler_peak", "live_bytes", "peak", "SOURCE"]
