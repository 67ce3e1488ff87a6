"""Measure a user's training script: run it for real on the CPU under the allocation tracker.

The same script, arguments and world as the prediction (models/script/run.py `script_context`: argv, a scratch
folder, offline), with real tensors: every storage it allocates and frees is the tracker's (traces/tracker/),
the position of each event comes from the same calls the prediction reads (models/script/phases.py
`ScriptPhases`), and the labels from the models and optimizers the script used, scanned after each backward,
optimizer step and zero_grad. It stops after the same number of optimizer steps. In a distributed script every
synchronous collective returns only once gloo has released its tensors (traces/harness.py `collectives_released`):
gloo's worker thread otherwise drops the last reference to its own copy of a reduce-scatter's input (the root
unit's gradients) at a moment that varies run to run, in some runs inside the next phase. The result is an `EventLog`
in the schema, held against the prediction by analysis/validate.py. peakledger/script.py runs it in a forked
child (models/script/child.py), as it runs the prediction.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..models.script.phases import Position, ScriptPhases
from ..models.script.record import label_state
from ..models.script.run import rank_env, run_path, script_context
from ..simulator.events import Category, EventLog
from ..simulator.run_metadata import RunMetadata
from .harness import ReleaseCount, collectives_released
from .tracker import AllocationTracker


def measure_script(path: Path, argv: list[str], steps: int | None, seconds: float | None = None,
                   threads: int = 1, rank: int = 0, world_size: int = 1, port: int = 29500) -> EventLog:
    """The script's real CPU run, tracked, as an `EventLog` (its metadata's `script_calls`: what it did): one rank of
    `world_size`, with torchrun's environment (MASTER_PORT `port`: the script's process group is real, gloo)."""
    tracker = AllocationTracker(discover_inputs=True, rank=rank)

    def position(p: Position) -> None:
        tracker.phase_state = (p.phase, p.step, p.micro_batch)

    def module(name: str | None) -> None:
        tracker.module_stack[:] = [name] if name else []

    def inputs(tensors: list) -> None:
        for k, t in enumerate(tensors):
            tracker.mark(t, Category.INPUT, name=f"batch.{k}")

    def scan(models: list, optimizers: list) -> None:
        label_state(models, optimizers, lambda t, category, name, state: tracker.mark(t, category, name=name,
                                                                                       state=state))

    def label(t, category, name, state) -> None:
        tracker.mark(t, category, name=name, state=state)

    phases = ScriptPhases(steps, on_position=position, on_scan=scan, on_inputs=inputs, on_module=module,
                          on_label=label)
    release = ReleaseCount()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with script_context(path, argv, rank_env(rank, world_size, port)):
            with phases, tracker, collectives_released(release, tracker):
                run_path(path, seconds)
            log = tracker.log(RunMetadata(source="torch-dispatch-tracker (peakledger run's measurement)",
                                          script=path.name))
    finally:
        torch.set_num_threads(previous)
    log.metadata = log.metadata.updated(script_calls=vars(phases.calls),
                                        **({"backend_release": dataclasses.asdict(release)} if world_size > 1 else {}))
    return log
