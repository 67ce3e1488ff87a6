"""A real CPU run of a torchao low-bit optimizer (models/lowbit.py), measured with torch.profiler as an EventLog.

torchao 0.18.0's `_AdamBase.step` runs `torch.compile(single_param_adam, fullgraph=True)` per parameter: under the
dispatch tracker (tracker/) dynamo refuses to trace ("non-infra torch dispatch mode present") and fullgraph turns
that into an error, and a tensor subclass's own ops (dequantise, quantise) run below the mode anyway. So the run is
measured as a compiled model is (compiled_run.py `profiled_events`: its loop with phase ranges and the allocator's
events): the optimizer's graphs are compiled first by a warm-up optimizer over copies of the parameters (same shapes,
dtypes and state subclasses), outside the profiler, then the measured run starts with no state, its compiled step
included.
"""

from __future__ import annotations

import torch

from ..models.config import TrainingSetup
from ..simulator.events import EventLog
from ..simulator.run_metadata import RunMetadata
from .compiled_run import SOURCE, profiled_events
from .reference import TORCH_DTYPES, build_model, make_batch, make_optimizer
from .reference.build import optimizer_class


def warm_up(optimizer_cls, kwargs: dict, params, steps: int = 2) -> None:
    """Compile the optimizer's step for every parameter signature of `params`: a throwaway optimizer over copies."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    warm = optimizer_cls(copies, lr=1e-3, **kwargs)
    for _ in range(steps):
        for p in copies:
            p.grad = torch.randn_like(p)
        warm.step()


def measure_lowbit(model_config, setup: TrainingSetup, seed: int = 0):
    """`setup.batch.steps` real training steps of the reference program with the setup's torchao optimizer, on one
    CPU thread, under torch.profiler. Returns (EventLog, the optimizer, whose state is the library's own)."""
    torch.set_num_threads(1)
    net = build_model(model_config, setup, seed)
    optimizer = make_optimizer(net, setup)
    batches = make_batch(model_config, setup, seed)
    cls, kwargs = optimizer_class(setup)
    warm_up(cls, kwargs, [p for p in net.parameters() if p.requires_grad])
    autocast = TORCH_DTYPES[setup.precision.autocast] if setup.precision.autocast else None
    torch.manual_seed(seed)
    events = profiled_events(net, optimizer, batches, setup, autocast, range(1, setup.batch.steps + 1),
                             kernel_temporaries=True)
    meta = RunMetadata(torch_version=torch.__version__, setup=setup, device="cpu", steps=setup.batch.steps,
                       compile={"optimizer_step": "torchao's torch.compile(single_param_adam) per parameter",
                                "measured_by": "torch.profiler memory timeline"})
    return EventLog(events=events, source=SOURCE, metadata=meta), optimizer


__all__ = ["measure_lowbit", "warm_up"]
