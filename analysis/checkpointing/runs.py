"""One simulation of a scenario and what is read from it: the device peak, the step's time and FLOPs per
requested step, the activations held on the host, the number of layers (analysis/checkpointing/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ...models.config import CHECKPOINTING
from ...models.families import family_of
from ...models.training import StepPlan, describe
from ...simulator.engine import simulate
from ...simulator.events import Category, EventLog, Phase, Pool
from ...simulator.ops import OpGraph
from ..device import device_settings, gpu_memory
from ..peaks import with_headroom

DEFAULT_POLICIES = tuple(p for p in CHECKPOINTING if p != "layers")
PLAIN, CHECKPOINTED = 0, 1


@dataclass(frozen=True)
class SimulatedRun:
    """A scenario described and simulated: its op graph, its event log, and the device peak of its worst
    rank (`rank`), plain and with the scenario's headroom."""

    graph: OpGraph
    log: EventLog
    peak: int  # device pool, the worst rank
    capacity_needed: int  # peak (on a CUDA profile: the device total) with the scenario's headroom
    rank: int
    outside: int = 0  # on a CUDA profile: what lies outside the allocator (context, NCCL's buffers), a constant


def simulate_run(scenario, ranks: list[int] | None = None) -> SimulatedRun:
    """Describe and simulate `scenario`; `ranks`: the representative ranks when already known (their
    classes do not depend on checkpointing, and finding them is most of a large data-parallel describe)."""
    graph = describe(scenario.model, scenario.setup, scenario.device, ranks=ranks, torch_version=scenario.torch_version)
    graph.metadata = graph.metadata.updated(**device_settings(scenario))
    log = simulate(graph, simulator=scenario.simulator)
    rank, peak = device_peak(log)
    gpu = gpu_memory(log, rank)  # on a CUDA profile a budget holds the device total (analysis/device.py)
    needed = gpu.total_peak.total if gpu is not None else peak
    outside = gpu.outside_total if gpu is not None else 0
    return SimulatedRun(graph, log, peak, with_headroom(needed, scenario.headroom), rank, outside)


def representatives(run: SimulatedRun) -> list[int]:
    return sorted({op.rank for op in run.graph.ops_in_order()})


def device_peak(log: EventLog) -> tuple[int, int]:
    """(rank, bytes) of the highest device-pool occupancy of any rank (the lowest rank on ties), as
    `analysis.report.summarize` reports it, in one pass."""
    running: dict[int, int] = {}
    best: dict[int, int] = {}
    for e in log.events:
        if e.block.pool is Pool.DEVICE:
            r = e.block.rank
            running[r] = running.get(r, 0) + e.delta
            if running[r] > best.get(r, -1):
                best[r] = running[r]
    if not best:
        return 0, 0
    rank = max(best, key=lambda r: (best[r], -r))
    return rank, best[rank]


def _step_ends(graph: OpGraph) -> dict[int, dict[int, float]]:
    """rank -> step -> when the rank's last op of that step ends (step 0: the load): each op starts when
    every predecessor has ended (stream order is an edge), as the engine runs it."""
    end: dict[int, float] = {}
    ends: dict[int, dict[int, float]] = {}
    for op in graph.ops_in_order():  # insertion order is topological
        end[op.id] = max((end[p] for p in graph.predecessors(op.id)), default=0.0) + op.duration
        steps = ends.setdefault(op.rank, {})
        steps[op.step] = max(steps.get(op.step, 0.0), end[op.id])
    return ends


def run_time(graph: OpGraph) -> float:
    """Simulated seconds from the first op's start to the last op's end, of the steps the graph holds."""
    return max((t for steps in _step_ends(graph).values() for t in steps.values()), default=0.0)


def step_time(graph: OpGraph) -> float:
    """Simulated seconds per requested step: the whole run's end over its steps, the steps the graph does
    not simulate counted as the simulated steps they repeat (`StepPlan.end_time`, rank by rank: each rank's
    steps repeat at its own pace)."""
    plan = StepPlan.of(graph.metadata)
    return max((plan.end_time(steps) for steps in _step_ends(graph).values()), default=0.0) / plan.steps


def simulated_steps(graph: OpGraph, steps: int | None = None) -> int:
    """How many optimizer steps the graph describes: its metadata's `steps_simulated` (`steps` for a graph
    without one)."""
    md = graph.metadata
    if md.steps_simulated is not None:
        return md.steps_simulated
    return steps if steps is not None else md.setup.batch.steps


def step_flops(graph: OpGraph, rank: int, steps: int | None = None) -> tuple[int, int]:
    """(forward + backward FLOPs without recompute, recomputed FLOPs) of one rank per optimizer step (every
    step does the same; divided by the steps the graph simulates, `steps` only for a graph that does not
    say)."""
    steps = simulated_steps(graph, steps)
    model = recompute = 0
    for op in graph.ops_in_order():
        if op.rank != rank:
            continue
        if op.recompute:
            recompute += op.flops
        elif op.phase in (Phase.FORWARD, Phase.BACKWARD):
            model += op.flops
    return model // steps, recompute // steps


def host_activations(log: EventLog, rank: int) -> int:
    """Most bytes of activations `rank` holds in host memory at once: offloaded saved tensors on a GPU
    profile (0 without offloading, and on a CPU profile, where host and device are one pool)."""
    running = best = 0
    for e in log.events:
        if e.block.pool is Pool.HOST and e.block.rank == rank and e.block.category is Category.ACTIVATION:
            running += e.delta
            best = max(best, running)
    return best


def n_layers(model, setup=None) -> int:
    """The layers checkpointing policies count, as the model's family counts them (`Family.layers`): transformer
    blocks, an MLP's Linear(+activation) pairs, or a traced model's repeated blocks (which need the setup)."""
    return family_of(model).layers(model, setup)
