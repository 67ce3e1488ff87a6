"""Capture a real CUDA memory snapshot of the reference model's training steps (GPU truth).

`capture_cuda(scenario, snapshot_path)` builds the plain-torch reference model of the scenario on
`cuda:0`, records the caching allocator's history (`torch.cuda.memory._record_memory_history`,
Python and C++ stacks, so autograd's device thread is recognisable), runs the same loop as
`traces.tracker.run_training_steps` (steps x (micro-batches of forward + backward), optimizer step,
zero_grad), dumps the snapshot pickle and reads it back through the restricted loader
(`traces.cuda_snapshot`), so the result is the same `EventLog` schema as every other trace.

Phases are not in a snapshot: each loop phase runs in its own function whose name carries the phase
(`_peakledger_backward`, `_peakledger_optimizer_step`), which the loader's stack heuristic reads.
On a machine without CUDA it raises `ConfigError` naming `device_kind` instead of failing inside torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from ..models.config import ConfigError
from .cuda_snapshot import SnapshotTrace, load_snapshot

MAX_ENTRIES = 1_000_000


def _peakledger_forward(model, x, y):
    return model(x, y)


def _peakledger_backward(loss):
    loss.backward()


def _peakledger_optimizer_step(optimizer):
    optimizer.step()


def _peakledger_zero_grad(optimizer, set_to_none: bool):
    optimizer.zero_grad(set_to_none=set_to_none)


def capture_cuda(scenario, snapshot_path: str | Path, max_entries: int = MAX_ENTRIES) -> SnapshotTrace:
    import torch

    from ..models.reference import build_model, make_batch, make_optimizer

    if not torch.cuda.is_available():
        raise ConfigError("device_kind", f"cuda capture needs a CUDA GPU; torch {torch.__version__} sees none here. "
                                         "Run it on a GPU machine, or use --device-kind cpu")
    setup = scenario.setup
    torch.manual_seed(0)
    model = build_model(scenario.model, setup).to("cuda")
    optimizer = make_optimizer(model, setup)
    batches = [tuple(t.to("cuda") for t in b) for b in make_batch(scenario.model, setup)]
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="all")
    try:
        for step in range(setup.steps):
            for mb in range(setup.grad_accum):
                x, y = (t.clone() for t in batches[(step * setup.grad_accum + mb) % len(batches)])
                autocast = setup.precision == "bf16-autocast"
                with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                    out, loss = _peakledger_forward(model, x, y)
                _peakledger_backward(loss)
                del out, loss, x, y
            _peakledger_optimizer_step(optimizer)
            _peakledger_zero_grad(optimizer, setup.set_to_none)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(snapshot_path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = load_snapshot(snapshot_path)
    trace.allocated.metadata.update({"torch_version": torch.__version__, "device": torch.cuda.get_device_name(0),
                                     "model": dataclasses.asdict(scenario.model), "setup": dataclasses.asdict(setup),
                                     "scenario": scenario.name, "source_pickle": Path(snapshot_path).name})
    return trace


__all__ = ["capture_cuda"]
