"""The public API: simulate a scenario, find the largest micro-batch, compare scenarios."""

from __future__ import annotations

import dataclasses

from .analysis.maxbatch import max_fitting
from .analysis.peaks import with_headroom
from .analysis.report import Report, summarize
from .models.training import describe
from .scenario import Scenario
from .simulator.engine import simulate
from .simulator.events import Category, Pool
from .simulator.timeline import timeline

STATE_CATEGORIES = (Category.PARAMETER, Category.MASTER_PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def run(scenario: Scenario, budget: int | None = None, stop_on_oom: bool = False) -> Report:
    """Describe, simulate and summarize one scenario (device pool; the report is of the rank with the
    highest peak, and lists every simulated rank's peak)."""
    graph = describe(scenario.model, scenario.setup, scenario.device)
    ranks = [int(r) for r in graph.metadata["rank_classes"]]
    capacities = {(r, Pool.DEVICE): budget for r in ranks} if budget is not None else None
    log = simulate(graph, capacities, stop_on_oom=stop_on_oom)
    return summarize(log, name=scenario.name, headroom=scenario.headroom)


def fixed_state_peak(scenario: Scenario) -> int:
    """Highest bytes of parameters + master weights + gradients + optimizer states at any moment."""
    graph = describe(scenario.model, dataclasses.replace(scenario.setup, micro_batch=1), scenario.device)
    log = simulate(graph)
    best = 0
    for rank in graph.metadata["rank_classes"]:
        running = 0
        for e in timeline(log, int(rank)).events:
            if e.block.category in STATE_CATEGORIES:
                running += e.delta
                best = max(best, running)
    return best


def max_micro_batch(scenario: Scenario, budget: int, limit: int = 1 << 20) -> int:
    """Largest micro-batch whose simulated peak x (1 + headroom) fits `budget`; 0 if only the fixed
    state fits, -1 if not even that."""
    cache: dict[int, int] = {}

    def need(b: int) -> int:
        if b not in cache:
            if b == 0:
                peak = fixed_state_peak(scenario)
                cache[b] = with_headroom(peak, scenario.headroom)
            else:
                cache[b] = run(dataclasses.replace(scenario, setup=dataclasses.replace(scenario.setup, micro_batch=b)))\
                    .peaks.capacity_needed
        return cache[b]

    return max_fitting(need, budget, limit)


def peers(scenario: Scenario) -> list[dict]:
    """The scenario under DeepSpeed ZeRO stages 0-3 on its world size: peakledger's model states and peak
    per rank (the worst rank) next to the ZeRO paper's formula and DeepSpeed's own estimators."""
    from .analysis.peers import (deepspeed_zero2_estimate, deepspeed_zero3_estimate, largest_layer_params,
                                 model_state_peak, zero_paper_model_states)
    from .models.training import build_tape

    tape = build_tape(scenario.model, scenario.setup)
    psi = tape.n_params
    largest = largest_layer_params({p.name: p.shape for p in tape.params})
    n = scenario.setup.world_size
    rows = []
    for stage in range(4):
        case = scenario.with_changes(dp_engine="deepspeed", zero_stage=stage)
        report = run(case)
        states = max(model_state_peak(report.log, rp.rank) for rp in report.ranks)
        deepspeed = {2: deepspeed_zero2_estimate(psi, n), 3: deepspeed_zero3_estimate(psi, largest, n)}.get(stage)
        rows.append({"stage": stage, "world_size": n, "n_params": psi, "model_states": states,
                     "peak": report.peaks.peak.bytes, "zero_paper": round(zero_paper_model_states(psi, n, stage)),
                     "deepspeed_estimate": deepspeed, "largest_layer_params": largest})
    return rows


VALIDATABLE_PRECISIONS = ("fp32", "bf16", "bf16-autocast")


def measure(scenario: Scenario):
    """Run the scenario for real on CPU: the reference torch model of the same config, real training
    steps under the exact allocation tracker. Returns the measured EventLog (metadata: torch version,
    model config, training setup)."""
    import torch

    from .models.config import ConfigError
    from .models.reference import build_model, make_batch, make_optimizer
    from .traces.tracker import run_training_steps

    setup = scenario.setup
    if setup.precision not in VALIDATABLE_PRECISIONS:
        raise ConfigError("precision", f"real CPU runs support {', '.join(VALIDATABLE_PRECISIONS)}; got "
                                       f"{setup.precision!r}")
    if setup.world_size != 1 or setup.zero_stage != 0:
        raise ConfigError("world_size", "real CPU runs are one process without ZeRO for now")
    if setup.optimizer == "adam-8bit":
        raise ConfigError("optimizer", "adam-8bit needs bitsandbytes (CUDA); use sgd, sgd-momentum, adam, "
                                       "adamw or amsgrad")
    model = build_model(scenario.model, setup)
    optimizer = make_optimizer(model, setup)
    metadata = {"torch_version": torch.__version__, "model": dataclasses.asdict(scenario.model),
                "model_kind": type(scenario.model).__name__, "setup": dataclasses.asdict(setup),
                "device": "cpu", "scenario": scenario.name}
    return run_training_steps(model, optimizer, make_batch(scenario.model, setup), steps=setup.steps,
                              grad_accum=setup.grad_accum, set_to_none=setup.set_to_none,
                              autocast=torch.bfloat16 if setup.precision == "bf16-autocast" else None,
                              metadata=metadata)


def validate(scenario: Scenario, measured=None):
    """Hold the simulation of `scenario` (on the "cpu" device profile) against a measured run: the one
    given, or a fresh real CPU run. Returns (Validation, measured log, simulated log)."""
    from .analysis.validate import compare_logs

    measured = measured if measured is not None else measure(scenario)
    simulated = simulate(describe(scenario.model, scenario.setup, "cpu"))
    return compare_logs(measured, simulated, name=scenario.name), measured, simulated
