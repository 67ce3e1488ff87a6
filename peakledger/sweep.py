"""Sweeps: one scenario simulated over a grid of any inputs, on every core, into CSV and JSON.

A grid is `{field: [values]}` over any TrainingSetup, model or run field (`micro_batch`, `seq_len`,
`zero_stage`, `checkpointing`, `n_layer`, `device`, ...); the points are the Cartesian product in the
order the fields were given. Each point is described and simulated independently (a process pool of
`jobs` workers; results come back in grid order, so the output does not depend on the scheduling),
optionally with the largest micro-batch that fits a budget. A point whose values are invalid
together (a stage with the wrong engine, a sequence longer than the model's) is a row with its error,
not a crash of the sweep. Output files are written atomically; same grid, same bytes.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import multiprocessing
import os
import sys
from dataclasses import dataclass

from .models.config import ConfigError
from .scenario import Scenario, parse_value
from .simulator.files import write_atomic

COLUMNS = ["peak_bytes", "first_step_peak_bytes", "steady_peak_bytes", "capacity_needed_bytes", "peak_op",
           "peak_phase", "peak_step", "step_time_s", "fits", "max_micro_batch", "error"]


@dataclass(frozen=True)
class SweepPoint:
    values: dict
    result: dict


def parse_grid(items: list[str]) -> dict[str, list]:
    """["micro_batch=1,2,4", "precision=fp32,bf16-mixed"] -> {"micro_batch": [1, 2, 4], ...}."""
    grid: dict[str, list] = {}
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key or not values.strip():
            raise ConfigError("grid", f"expected key=value1,value2,... got {item!r}")
        if key in grid:
            raise ConfigError("grid", f"{key} is given twice")
        grid[key] = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise ConfigError("grid", "give at least one --grid key=value1,value2")
    return grid


def points(grid: dict[str, list]) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _evaluate(task: tuple[Scenario, dict, int | None, bool]) -> dict:
    from . import api

    base, values, budget, max_batch = task
    out = {c: "" for c in COLUMNS}
    try:
        scenario = base.with_changes(**values)
        report = api.run(scenario)
    except ConfigError as e:
        out["error"] = str(e)
        return out
    pk = report.peaks
    out.update(peak_bytes=pk.peak.bytes, first_step_peak_bytes=pk.first_step.bytes,
               steady_peak_bytes=pk.steady.bytes if pk.steady else "", capacity_needed_bytes=pk.capacity_needed,
               peak_op=pk.peak.event.op if pk.peak.event else "", peak_phase=pk.peak.event.phase.value
               if pk.peak.event else "", peak_step=pk.peak.event.step if pk.peak.event else "",
               step_time_s=report.log.events[-1].time / max(1, report.steps) if report.log.events else 0.0)
    if budget is not None:
        out["fits"] = pk.capacity_needed <= budget
        if max_batch:
            out["max_micro_batch"] = api.max_micro_batch(scenario, budget)
    return out


def run_sweep(base: Scenario, grid: dict[str, list], budget: int | None = None, max_batch: bool = False,
              jobs: int | None = None, progress: bool = True) -> list[SweepPoint]:
    """Simulate every grid point (in parallel); results in grid order."""
    if max_batch and budget is None:
        raise ConfigError("budget", "--max-batch needs --budget")
    unknown = sorted(set(grid) - base.settings())
    if unknown:  # a misspelt field is an error, not a grid of error rows
        raise ConfigError("grid", f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(base.settings()))}")
    pts = points(grid)
    tasks = [(base, p, budget, max_batch) for p in pts]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[dict] = []
    bar = _progress(len(tasks), progress)
    if jobs == 1:
        for t in tasks:
            results.append(_evaluate(t))
            bar.advance()
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for r in pool.imap(_evaluate, tasks, chunksize=max(1, len(tasks) // (jobs * 16))):
                results.append(r)
                bar.advance()
    bar.close()
    return [SweepPoint(values=p, result=r) for p, r in zip(pts, results)]


class _progress:
    """A rich progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress
            self.bar = Progress(transient=True, console=None)
            self.bar.start()
            self.task = self.bar.add_task("simulating", total=total)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def to_csv(sweep: list[SweepPoint]) -> str:
    keys = list(sweep[0].values) if sweep else []
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys + COLUMNS)
    for p in sweep:
        w.writerow([_cell(p.values[k]) for k in keys] + [p.result[c] for c in COLUMNS])
    return buf.getvalue()


def to_json(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list]) -> str:
    return json.dumps({"scenario": base.name, "grid": {k: [_cell(v) for v in vs] for k, vs in grid.items()},
                       "unit": "B", "points": [{"values": {k: _cell(v) for k, v in p.values.items()},
                                                **{c: p.result[c] for c in COLUMNS}} for p in sweep]},
                      indent=1, default=str) + "\n"


def _cell(value):
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def write(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list], csv_path: str | None,
          json_path: str | None) -> None:
    if csv_path:
        write_atomic(csv_path, to_csv(sweep).encode())
    if json_path:
        write_atomic(json_path, to_json(sweep, base, grid).encode())


__all__ = ["parse_grid", "points", "run_sweep", "to_csv", "to_json", "write", "COLUMNS"]
