"""One sweep point: its scenario described and simulated, into one row of result columns (those of the grid's
fields, DESCRIBE, COLUMNS and, with a deadline, DEADLINE_COLUMNS). Runs in whichever process an engine sends it to."""

from __future__ import annotations

from dataclasses import dataclass

from .. import api
from .. import deadline as dl
from ..models.config import ConfigError
from ..models.costs import device_profile
from ..scenario import Scenario

# what a point is of (each one not varied by the grid becomes a column after the grid's)
DESCRIBE = ["model", "precision", "device", "world_size"]
COLUMNS = ["peak_bytes", "first_step_peak_bytes", "steady_peak_bytes", "capacity_needed_bytes", "peak_op",
           "peak_phase", "peak_step", "step_time_s", "budget_bytes", "fits", "max_micro_batch", "error"]
# with a deadline (peakledger/deadline.py plan_point, and the rank among the points)
DEADLINE_COLUMNS = ["target_tokens", "tokens_per_step", "steps_needed", "step_time_used_s", "step_time_source",
                    "wall_clock_h", "deadline_h", "meets_deadline", "late_by_h", "over_budget_bytes", "gpu_hours",
                    "meets_both", "deadline_rank", "verdict"]


@dataclass(frozen=True)
class SweepPoint:
    values: dict
    result: dict



def describe(base: Scenario) -> dict:
    """The DESCRIBE columns of the base scenario (a grid that varies one of them has its own column instead)."""
    return {"model": base.model.name, "precision": base.setup.precision, "device": base.device,
            "world_size": base.setup.world_size}


def evaluate(task: tuple[Scenario, dict, int | None, bool, dl.DeadlineBudget | None]) -> dict:
    base, values, budget, max_batch, deadline = task
    out = {**describe(base), **{c: "" for c in COLUMNS + (DEADLINE_COLUMNS if deadline else [])}}
    try:
        scenario = base.with_changes(**values)
        report = api.run(scenario)
        if budget is None and deadline is not None:  # the point's own device: its capacity
            budget = device_profile(scenario.device).memory_bytes
    except ConfigError as e:
        out["error"] = str(e)
        if deadline is not None:
            out["verdict"] = dl.INVALID
        return out
    pk = report.peaks
    out.update(peak_bytes=pk.peak.bytes, first_step_peak_bytes=pk.first_step.bytes,
               steady_peak_bytes=pk.steady.bytes if pk.steady else "", capacity_needed_bytes=report.capacity_needed,
               peak_op=pk.peak.event.op if pk.peak.event else "", peak_phase=pk.peak.event.phase.value
               if pk.peak.event else "", peak_step=pk.peak.event.step if pk.peak.event else "",
               step_time_s=report.time_per_step_s)
    if budget is not None:
        out["budget_bytes"] = budget
        out["fits"] = api.fits(report, budget)  # on a GPU profile: the caching allocator within the budget
        if max_batch:
            out["max_micro_batch"] = api.max_micro_batch(scenario, budget)
    if deadline is not None:
        s = scenario.setup
        step_time, source = dl.steady_step_seconds(report.log) if deadline.step_time_s is None else (0.0, "")
        out.update(dl.plan_point(deadline, tokens=dl.tokens_per_step(s.micro_batch, s.seq_len, s.grad_accum, s.dp),
                                 step_time_s=step_time, step_time_source=source, world_size=s.world_size,
                                 capacity_needed=report.capacity_needed, fits=out["fits"], memory_bytes=budget))
    return out


def evaluate_chunk(tasks: list) -> list[dict]:
    """One task of a pool or cluster: consecutive points, so the base scenario is sent once per chunk."""
    return [evaluate(t) for t in tasks]


__all__ = ["DESCRIBE", "COLUMNS", "DEADLINE_COLUMNS", "SweepPoint", "describe", "evaluate_chunk"]
