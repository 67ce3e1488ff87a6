"""The second measured source: torch.profiler's memory timeline (`profile_memory=True`) as an EventLog.

torch's own categories (torch/profiler/_memory_profiler.py) map onto ours; AUTOGRAD_DETAIL counts as
a temporary, an uncategorised tensor as UNKNOWN. The timeline has no training-loop phases, so every
event is tagged Phase.FORWARD, step 0: compare it to the tracker by peak and by category, not by phase.
The profiler mislabels some optimizer temporaries (see the shared notes): the tracker's labels are
the ones to trust, the profiler's bytes are the cross-check.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action as PAction

from ..simulator.events import Action, Block, Category, Event, EventLog, Phase, Pool, Stream
from ..simulator.run_metadata import RunMetadata
from .tracker import batch_for

SOURCE = "torch-profiler"


def category_of(profiler_category) -> Category:
    if profiler_category is None:
        return Category.UNKNOWN
    name = profiler_category.name
    return {"AUTOGRAD_DETAIL": Category.TEMPORARY}.get(name) or Category.__members__.get(name, Category.UNKNOWN)


def profiled_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                    grad_accum: int = 1, set_to_none: bool = True, seed: int = 0):
    """The tracker's training loop under torch.profiler (profile_memory=True); its MemoryProfile."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for step in range(1, steps + 1):
            for mb in range(grad_accum):
                x, y = (t.clone() for t in batch_for(batches, step, mb, grad_accum))
                out, loss = model(x, y)
                loss.backward()
                del out, loss, x, y
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return prof._memory_profile()


def profile_training_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                           grad_accum: int = 1, set_to_none: bool = True, seed: int = 0) -> EventLog:
    """The tracker's training loop under torch.profiler; the memory timeline as an EventLog (CPU only,
    the host-side `batches` themselves excluded, as the tracker excludes them)."""
    memory = profiled_memory(model, optimizer, batches, steps, grad_accum, set_to_none, seed)
    cpu = torch.device("cpu")
    host_batch = {t.untyped_storage().data_ptr() for b in batches for t in b}
    live: dict = {}  # TensorKey -> Block
    events: list[Event] = []
    next_id = 0
    for t, action, (key, version), nbytes in memory.timeline:
        ptr = getattr(getattr(key, "storage", None), "ptr", id(key))
        if getattr(key, "device", cpu) != cpu or (action == PAction.PREEXISTING and ptr in host_batch):
            continue
        if action in (PAction.PREEXISTING, PAction.CREATE):
            next_id += 1
            block = Block(id=next_id, nbytes=int(nbytes), category=category_of(memory._categories.get(key, version)),
                          name=f"storage@{ptr:#x}", dtype="?", pool=Pool.DEVICE)
            live[key] = block
            kind = Action.ALLOC
        elif action == PAction.DESTROY:
            block = live.pop(key, None)
            if block is None:  # same storage under another key identity (a new tensor id for it)
                match = next((k for k, b in live.items() if b.name == f"storage@{ptr:#x}" and b.nbytes == nbytes), None)
                if match is None:
                    continue
                block = live.pop(match)
            kind = Action.FREE
        else:  # INCREMENT_VERSION: same memory, new contents
            continue
        events.append(Event(seq=len(events), time=t / 1e9, action=kind, block=block, phase=Phase.FORWARD, step=0,
                            micro_batch_index=-1, stream=Stream.COMPUTE, op=action.name.lower()))
    return EventLog(events=events, source=SOURCE, metadata=RunMetadata(torch_version=torch.__version__,
                                                                       phases="none (profiler timeline)"))


def profiler_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                  grad_accum: int = 1, set_to_none: bool = True, seed: int = 0) -> int:
    """The same loop under `torch.profiler` (profile_memory=True): the memory timeline's peak bytes on CPU,
    event by event, pre-existing tensors included except the host-side `batches` themselves (the tracker
    does not count them either: it counts the per-micro-batch copies, as the simulator does)."""
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
