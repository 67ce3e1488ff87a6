"""The training loop run under the tracker: `run_training_steps` (a real CPU loop, tracked from the start, its
`EventLog` returned), `training_loop` (that loop, phase by phase, under a tracker already entered) and `batch_for`
(which of the batches a micro-batch uses)."""

from __future__ import annotations

import contextlib

import torch

from ...simulator.events import Category, EventLog, Phase
from ...simulator.run_metadata import RunMetadata
from .allocation import AllocationTracker, tensors_in


def batch_for(batches, step: int, mb: int, grad_accum: int):
    return batches[((step - 1) * grad_accum + mb) % len(batches)]


def run_training_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int = 2,
                       grad_accum: int = 1, set_to_none: bool = True, seed: int = 0,
                       saved_tensor_hooks: bool = True, metadata: RunMetadata | None = None,
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
        training_loop(tracker, model, optimizer, batches, steps, grad_accum, set_to_none, autocast)
    meta = RunMetadata(steps=steps, grad_accum=grad_accum, set_to_none=set_to_none,
                       optimizer=type(optimizer).__name__, autocast=None if autocast is None else str(autocast))
    return tracker.log(meta.updated(metadata))


def training_loop(tracker: AllocationTracker, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches,
                  steps: int = 2, grad_accum: int = 1, set_to_none: bool = True,
                  autocast: torch.dtype | None = None, first_step: int = 1) -> None:
    """`run_training_steps`'s loop, phase by phase, under an already entered `tracker` (which may label a
    different module or optimizer than the ones called here: the module inside a DDP wrapper, the local
    optimizer inside a ZeroRedundancyOptimizer). Steps are numbered from `first_step`, so a caller can
    run them one at a time with its own phases in between (a checkpoint save after each)."""
    for step in range(first_step, first_step + steps):
        for mb in range(grad_accum):
            with tracker.phase(Phase.FORWARD, step, mb):
                batch = tuple(t.clone() for t in batch_for(batches, step, mb, grad_accum))  # (x, y), or a
                tracker.mark_input(*batch)  # traced model's batch tensors (traces/reference/traced.py real_model)
                with (torch.autocast("cpu", dtype=autocast) if autocast is not None
                      else contextlib.nullcontext()):
                    out, loss = model(*batch)
                _mark_held(tracker, out)  # held by the caller until backward ends
            with tracker.phase(Phase.BACKWARD, step, mb):
                loss.backward()
                del out, loss, batch
                tracker.scan()
        with tracker.phase(Phase.OPTIMIZER, step):
            optimizer.step()
            tracker.scan()
        with tracker.phase(Phase.ZERO_GRAD, step):
            optimizer.zero_grad(set_to_none=set_to_none)
            tracker.scan()


def _mark_held(tracker: AllocationTracker, out) -> None:
    """Label the tensors of a model's output (a tensor, or a structure of them: a HF ModelOutput)."""
    for t in tensors_in(out):
        tracker.mark(t, Category.ACTIVATION)
