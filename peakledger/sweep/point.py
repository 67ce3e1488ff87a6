"""One sweep point: its scenario described and simulated, into one row of result columns (those of the grid's
fields, DESCRIBE, COLUMNS and, with a deadline, DEADLINE_COLUMNS). Runs in whichever process an engine sends it to."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import api
from .. import deadline as dl
from ..analysis.report import Report
from ..models.config import ConfigError
from ..scenario import Scenario

# what a point is of (each one not varied by the grid becomes a column after the grid's)
DESCRIBE = ["model", "precision", "device", "world_size"]
COLUMNS = ["peak_bytes", "first_step_peak_bytes", "steady_peak_bytes", "capacity_needed_bytes", "peak_op",
           "peak_phase", "peak_step", "step_time_s", "budget_bytes", "fits", "max_micro_batch", "error"]
# with a deadline (peakledger/deadline.py plan_point, and the rank among the points); `priced_micro_batch`: the
# micro-batch the columns after it price (the point's; with max-batch the largest that fits, or 1 where none does)
DEADLINE_COLUMNS = ["target_tokens", "priced_micro_batch", "tokens_per_step", "steps_needed", "step_time_used_s",
                    "step_time_source", "wall_clock_h", "deadline_h", "meets_deadline", "late_by_h",
                    "over_budget_bytes", "gpu_hours", "meets_both", "deadline_rank", "verdict"]


@dataclass(frozen=True)
class SweepPoint:
    values: dict
    result: dict



def describe(base: Scenario) -> dict:
    """The DESCRIBE columns of the base scenario (a grid that varies one of them has its own column instead)."""
    return {"model": base.model.name, "precision": base.setup.precision.name, "device": base.device,
            "world_size": base.setup.mesh.world_size}


def evaluate(task: tuple[Scenario, dict, int | None, bool, dl.DeadlineBudget | None]) -> dict:
    """One point's row: the scenario with the point's values, simulated; with a budget its fit (and with
    `max_batch` its largest micro-batch that fits); with a deadline its deadline columns (`price`). Invalid values,
    and a point the deadline cannot price (dl.point_budget: cpu without a budget, forward passes only; dl.plan_point:
    a price that is not finite), are the row's `error` (verdict invalid with a deadline), not a crash."""
    base, values, budget, max_batch, deadline = task
    out = {**describe(base), **{c: "" for c in COLUMNS + (DEADLINE_COLUMNS if deadline else [])}}
    try:
        scenario = base.with_changes(**values)
        if deadline is not None:  # a real capacity (the budget, else a GPU profile's) and training steps, or refused
            budget = dl.point_budget(scenario, budget)
        report = api.run(scenario)
    except ConfigError as e:
        return _invalid(out, e, deadline)
    pk = report.peaks
    out.update(peak_bytes=pk.overall.bytes, first_step_peak_bytes=pk.first_step.bytes,
               steady_peak_bytes=pk.steady.bytes if pk.steady else "", capacity_needed_bytes=report.capacity_needed,
               peak_op=pk.overall.event.op if pk.overall.event else "", peak_phase=pk.overall.event.phase.value
               if pk.overall.event else "", peak_step=pk.overall.event.step if pk.overall.event else "",
               step_time_s=report.time_per_step_s)
    if budget is not None:
        out["budget_bytes"] = budget
        out["fits"] = api.fits(report, budget)  # on a GPU profile: the caching allocator within the budget
        if max_batch:
            out["max_micro_batch"] = api.max_micro_batch(scenario, budget)
    if deadline is not None:
        try:
            if not math.isfinite(report.time_per_step_s):  # no inf or nan in a deadline sweep's row
                out["step_time_s"] = ""
                raise ConfigError("step_time_s", f"the cost model's step time is {report.time_per_step_s}: not a "
                                                 "time to price; give --step-time, a measured step")
            out.update(price(scenario, report, budget, out["max_micro_batch"] if max_batch else None, deadline))
        except ConfigError as e:
            return _invalid(out, e, deadline)
    return out


def price(scenario: Scenario, report: Report, budget: int, max_micro_batch: int | None,
          deadline: dl.DeadlineBudget) -> dict:
    """The deadline columns of a point whose simulation is `report`. Without max-batch (`max_micro_batch` None) the
    point's own setup is priced. With it, the setup the sweep recommends: the point at `max_micro_batch`,
    simulated (its step time and its fit); where no micro-batch fits (0: only the fixed state fits, -1: not even
    that), micro-batch 1, priced as not fitting (OOM by what it needs over the budget). `priced_micro_batch` says
    which micro-batch the columns price."""
    s = scenario.setup
    micro_batch, priced = s.batch.micro_batch, report
    if max_micro_batch is not None:
        micro_batch = max(1, max_micro_batch)
        if micro_batch != s.batch.micro_batch:
            priced = api.run(scenario.with_changes(micro_batch=micro_batch))
    fits = api.fits(priced, budget) and (max_micro_batch is None or max_micro_batch >= 1)
    step_time, source = dl.steady_step_seconds(priced.log) if deadline.step_time_s is None else (0.0, "")
    return dl.plan_point(
        deadline,
        tokens=dl.tokens_per_step(micro_batch, s.batch.seq_len, s.batch.grad_accum, s.mesh.dp),
        step_time_s=step_time,
        step_time_source=source,
        world_size=s.mesh.world_size,
        capacity_needed=priced.capacity_needed,
        fits=fits,
        memory_bytes=budget,
        micro_batch=micro_batch,
    )


def _invalid(out: dict, error: ConfigError, deadline: dl.DeadlineBudget | None) -> dict:
    """The row of a point that could not be simulated or priced: its error, and with a deadline verdict invalid
    (the deadline columns stay empty: no price)."""
    out["error"] = str(error)
    if deadline is not None:
        out.update({c: "" for c in DEADLINE_COLUMNS}, verdict=dl.INVALID)
    return out


def evaluate_chunk(tasks: list) -> list[dict]:
    """One task of a pool or cluster: consecutive points, so the base scenario is sent once per chunk."""
    return [evaluate(t) for t in tasks]


__all__ = ["DESCRIBE", "COLUMNS", "DEADLINE_COLUMNS", "SweepPoint", "describe", "evaluate", "evaluate_chunk",
           "price"]
