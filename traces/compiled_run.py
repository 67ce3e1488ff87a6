"""A real torch.compile'd training run on this CPU, measured with torch.profiler's memory timeline, as an EventLog.

The dispatch tracker (tracker/) cannot measure a compiled step: inductor's wrapper allocates its buffers with
`empty_strided_cpu` (`torch._C._dynamo.guards._empty_strided_cpu`), a C++ call below the dispatcher, and dynamo runs
eagerly under an active TorchDispatchMode. torch.profiler sees the CPU allocator itself (`profile_memory=True`), so
its memory timeline (`prof._memory_profile().timeline`, as profiler.py reads it) is the measurement here.

The run is the tracker's loop (tracker/loop.py `training_loop`) on the traced model's real program (reference/traced.py
`real_model`), its `forward` (the forward and the loss, `models/compile/step.py`) compiled by `torch.compile` in
the setup's mode. The compile itself runs first, outside the profiler (profiling a compile holds every event of
dynamo and inductor): one forward and backward, then `zero_grad(set_to_none=True)`, so the measured steps start
as a fresh run does, with no `.grad` and no optimizer state. Each phase of the loop is a `record_function` range;
an allocation or free belongs to the phase whose range holds its time. The optimizer step is eager.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.profiler._memory_profiler import Action as PAction

from ..models.compile.step import CPU_THREADS
from ..models.config import ConfigError, TrainingSetup
from ..models.traced.model import TracedModel
from ..simulator.events import Action, Block, Category, Event, EventLog, Phase, Pool, Stream
from ..simulator.run_metadata import RunMetadata
from .profiler import category_of
from .reference import TORCH_DTYPES, build_model, make_batch, make_optimizer
from .tracker import batch_for

SOURCE = "torch-profiler (compiled)"
MARK = "peakledger:"


def _loop(model, optimizer, batches, setup: TrainingSetup, autocast, steps: range, marks: bool) -> None:
    for step in steps:
        for mb in range(setup.batch.grad_accum):
            with _mark(marks, Phase.FORWARD, step, mb):
                batch = tuple(t.clone() for t in batch_for(batches, step, mb, setup.batch.grad_accum))
                with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                    out, loss = model(*batch)
            with _mark(marks, Phase.BACKWARD, step, mb):
                loss.backward()
                del out, loss, batch
        if not marks:
            return  # the compile's warm-up: no optimizer step
        with _mark(marks, Phase.OPTIMIZER, step, -1):
            optimizer.step()
        with _mark(marks, Phase.ZERO_GRAD, step, -1):
            optimizer.zero_grad(set_to_none=setup.optimizer.set_to_none)


def _mark(on: bool, phase: Phase, step: int, mb: int):
    return record_function(f"{MARK}{phase.value}:{step}:{mb}") if on else contextlib.nullcontext()


def _ranges(prof) -> list[tuple[int, int, Phase, int, int]]:
    """(start ns, end ns, phase, step, micro-batch) of every phase range, from the profiler's event tree."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name.startswith(MARK):
            phase, step, mb = e.name[len(MARK):].split(":")
            out.append((e.start_time_ns, e.end_time_ns, Phase(phase), int(step), int(mb)))
        stack.extend(e.children)
    return sorted(out)


def _events(memory, prof, ranges, host_batch: set, model, kernel_temporaries: bool = False) -> list[Event]:
    """The allocator's own events (every allocation and free the profiler saw, `_EventType.Allocation`, in time
    order) as Events; what was alive before the run (parameters, buffers) from the memory timeline's PREEXISTING
    entries, the host-side batch left out as the tracker leaves it out, and the module's parameters and buffers no
    profiled op touched (the timeline knows only the tensors its aten ops read: Llama's `original_inv_freq`; under
    LoRA the frozen norm weights, which only inductor's C++ kernels read and no optimizer updates). A block's
    category is the memory profiler's for the storage created there and then (torch/profiler/_memory_profiler.py),
    else unknown. With `kernel_temporaries`, a block allocated and freed inside one call of a top-level aten op (the
    outermost `aten::` event above the allocation, as the dispatch tracker would see the call: oneDNN's GEMM
    scratchpad inside `aten::addmm` / `aten::mm`, a loss kernel's unreduced buffer) is that op's: category
    workspace, named `<op>.workspace`, its op the op's name and the aten op it called that holds the allocation
    (`aten::linear > aten::addmm`); one under a compiled region is inductor's (no aten op above it) and keeps its
    label."""
    from torch._C._profiler import _EventType

    cpu = torch.device("cpu")
    live: dict[int, Block] = {}
    events: list[Event] = []
    category = {}
    for t, action, (key, version), _ in memory.timeline:
        ptr = getattr(getattr(key, "storage", None), "ptr", None)
        if action == PAction.CREATE and ptr is not None and getattr(key, "device", cpu) == cpu:
            category[(t, ptr)] = category_of(memory._categories.get(key, version))

    def add(kind: Action, block: Block, where, op: str | None = None) -> None:
        events.append(Event(seq=len(events), time=float(len(events)), action=kind, block=block, phase=where[0],
                            step=where[1], micro_batch_index=where[2], stream=Stream.COMPUTE, op=op or kind.value))

    for t, action, (key, version), nbytes in memory.timeline:
        ptr = getattr(getattr(key, "storage", None), "ptr", None)
        if action != PAction.PREEXISTING or ptr is None or getattr(key, "device", cpu) != cpu or ptr in host_batch:
            continue
        labelled = category_of(memory._categories.get(key, version))
        block = Block(id=len(events) + 1, nbytes=int(nbytes), category=labelled,
                      name=f"storage@{ptr:#x}", dtype="?", pool=Pool.DEVICE)
        live[ptr] = block
        add(Action.ALLOC, block, (Phase.LOAD, 0, -1))
    held = [(n, p, Category.PARAMETER) for n, p in model.named_parameters()] + \
        [(n, b, Category.BUFFER) for n, b in model.named_buffers()]
    for name, t, kind in held:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in live and t.untyped_storage().nbytes():
            live[ptr] = Block(id=len(events) + 1, nbytes=t.untyped_storage().nbytes(), category=kind, name=name,
                              dtype="?", pool=Pool.DEVICE)
            add(Action.ALLOC, live[ptr], (Phase.LOAD, 0, -1))
    def _name(e) -> str:
        """An op event's name; "" where kineto hands back bytes that are not UTF-8 (seen once under load: an event
        the tree walk meets whose name is not an op's)."""
        try:
            return e.name
        except UnicodeDecodeError:
            return ""

    raw, stack = [], [(e, None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, outer = stack.pop()
        if e.tag == _EventType.Allocation:
            if e.extra_fields.device == cpu:
                raw.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, outer))
        elif kernel_temporaries and _name(e).startswith("aten::") and (outer is None or " > " not in outer[0]):
            # the top-level op's call, and the op it called that holds the allocation (linear > addmm)
            outer = (e.name, e.start_time_ns, e.end_time_ns) if outer is None else (f"{outer[0]} > {e.name}",
                                                                                     *outer[1:])
        stack.extend((c, outer) for c in e.children)
    raw.sort(key=lambda r: r[0])
    inside = _kernel_temporaries(raw) if kernel_temporaries else {}
    k, where = 0, (Phase.LOAD, 0, -1)
    for n, (t, ptr, size, _) in enumerate(raw):
        while k < len(ranges) and ranges[k][1] < t:
            k += 1
        if k < len(ranges) and ranges[k][0] <= t:
            where = ranges[k][2:]
        if size > 0 and n in inside:
            live[ptr] = Block(id=len(events) + 1, nbytes=int(size), category=Category.WORKSPACE,
                              name=f"{inside[n]}.workspace", dtype="?", pool=Pool.DEVICE)
            add(Action.ALLOC, live[ptr], where, inside[n])
        elif size > 0:
            block = Block(id=len(events) + 1, nbytes=int(size), category=category.get((t, ptr), Category.UNKNOWN),
                          name=f"storage@{ptr:#x}", dtype="?", pool=Pool.DEVICE)
            live[ptr] = block
            add(Action.ALLOC, block, where)
        elif ptr in live:
            add(Action.FREE, live.pop(ptr), where)
    return events


def _kernel_temporaries(raw: list) -> dict[int, str]:
    """{index in `raw` of an allocation: its op's name} for each allocation whose free (the next event of its
    pointer) falls inside the same call of its outermost aten op (`raw`: time, ptr, size, that call's
    (name, start, end) or None, in time order)."""
    out, open_at = {}, {}
    for n, (t, ptr, size, outer) in enumerate(raw):
        if size > 0:
            open_at[ptr] = n
        elif ptr in open_at:
            a = open_at.pop(ptr)
            op = raw[a][3]
            if op is not None and op[1] <= t <= op[2]:
                out[a] = op[0]
    return out


def measure_compiled(model: TracedModel, setup: TrainingSetup, seed: int = 0) -> EventLog:
    """Run `setup.batch.steps` compiled training steps of `model` for real on the CPU (see the module docstring)."""
    import torch._dynamo

    if not isinstance(model, TracedModel):
        raise ConfigError("compile", "a compiled run is measured for traced models (--hf-config or --module)")
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)  # the program the describer compiles (models/compile/step.py)
    try:
        return _measure(model, setup, seed)
    finally:
        torch.set_num_threads(threads)


def _measure(model: TracedModel, setup: TrainingSetup, seed: int) -> EventLog:
    import torch._dynamo

    torch._dynamo.reset()
    net = build_model(model, setup, seed)
    optimizer = make_optimizer(net, setup)
    batches = make_batch(model, setup, seed)
    net.forward = torch.compile(net.forward, mode=setup.compile.mode, dynamic=False)  # (out, loss_fn(out))
    autocast = TORCH_DTYPES[setup.precision.autocast] if setup.precision.autocast else None
    torch.manual_seed(seed)
    _loop(net, optimizer, batches, setup, autocast, range(1, 2), marks=False)  # compiles forward and backward
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        _loop(net, optimizer, batches, setup, autocast, range(1, setup.batch.steps + 1), marks=True)
    memory = prof._memory_profile()  # torch/profiler/_memory_profiler.py MemoryProfile
    ranges = _ranges(prof)
    torch._dynamo.reset()
    events = _events(memory, prof, ranges, {t.untyped_storage().data_ptr() for b in batches for t in b}, net)
    metadata = RunMetadata(torch_version=torch.__version__, model=dataclasses.asdict(model), model_kind="TracedModel",
                           setup=setup, device="cpu", steps=setup.batch.steps,
                           compile={"mode": setup.compile.mode, "optimizer_step": "eager",
                                    "measured_by": "torch.profiler memory timeline"})
    return EventLog(events=events, source=SOURCE, metadata=metadata)


def profiled_events(net, optimizer, batches, setup: TrainingSetup, autocast, steps: range,
                    kernel_temporaries: bool = False) -> list[Event]:
    """This module's loop over `steps` (phase ranges marked) under torch.profiler, and its allocator events as
    `_measure` reads them: for another program measured the same way (lowbit_run.py: torchao's compiled step);
    `kernel_temporaries` names the blocks an aten op allocates and frees inside one call (`_events`)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        _loop(net, optimizer, batches, setup, autocast, steps, marks=True)
    return _events(prof._memory_profile(), prof, _ranges(prof),
                   {t.untyped_storage().data_ptr() for b in batches for t in b}, net, kernel_temporaries)


__all__ = ["measure_compiled", "profiled_events", "SOURCE"]
