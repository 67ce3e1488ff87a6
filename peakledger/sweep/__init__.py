"""Sweeps: one scenario simulated over a grid of any inputs, on every core or a cluster, into CSV and JSON.

A grid is `{field: [values]}` over any TrainingSetup, model or run field (`micro_batch`, `seq_len`,
`zero_stage`, `checkpointing`, `n_layer`, `device`, ...); the points are the Cartesian product in the
order the fields were given. Each point is described and simulated independently, optionally with the
largest micro-batch that fits a budget. A point whose values are invalid together (a stage with the
wrong engine, a sequence longer than the model's) is a row with its error, not a crash of the sweep.
Output files are written atomically; same grid, same bytes.

The CSV describes itself: the grid's fields, then the model, precision, device and world size of the points (those
the grid does not vary), then the results, each with its unit in its name (`peak_bytes`, `mean_step_time_s`,
`budget_bytes`: what `fits` was checked against), seconds and hours rounded (peakledger/sweep/output.py: the
CSV's names and rounding; the JSON keeps the result keys, unrounded). With a deadline
(`deadline=DeadlineBudget(...)`, the CLI's `--target-tokens` / `--target-steps`, `--deadline`, `--step-time`) each
point also gets the deadline columns of peakledger/deadline.py (tokens per step, steps needed, wall-clock,
GPU-hours, verdict, `deadline_rank`): the columns are computed where the point runs, the ranking once all have come
back, so every engine gives the same bytes. Without `budget`, a deadline sweep checks each point against its
device profile's capacity.

Engines (where the points run; the rows, their order and the output bytes are the same on every one):

- `local`: a fork pool of `jobs` processes on this machine (default every core; `jobs=1` runs inline).
- `ray` / `dask` (optional extras `peakledger[ray]`, `peakledger[dask]`): the points go in chunks to an
  existing cluster at `address`, or to a local cluster of `jobs` single-threaded workers started for
  the run and shut down afterwards on every exit path. A local cluster listens on 127.0.0.1 only (ray:
  when ray is first imported by the sweep, as it reads that setting then) and ray's usage statistics are
  off, unless the environment says otherwise. Dask starts its workers with multiprocessing's spawn, which
  re-imports the calling script: guard it with `if __name__ == "__main__"`. On an existing cluster the
  workers need peakledger installed.

Results come back out of order on a cluster and are put back by chunk index. A progress bar goes to
stderr when it is a terminal, on every engine.

Ctrl-C (SIGINT) or SIGTERM during a sweep: the workers stop (the local pool's workers ignore SIGINT, so
only the parent reacts, and it terminates them; cluster futures are cancelled and a local cluster is
shut down), nothing is returned, so nothing is written, and KeyboardInterrupt leaves `run_sweep` for
the caller (the CLI prints one line, exit 130; a SIGTERM handler the caller installed is kept and its
exception leaves instead). Worker processes are started with SIGINT blocked, so a terminal's Ctrl-C,
which reaches the whole process group, gives no worker tracebacks; an interrupt while a cluster is
starting takes effect once it has started (a second one stops waiting for it); while connecting to an existing
cluster, at once.

Faults and bounds (peakledger/sweep/pool.py, bounds.py, address.py): a worker lost mid-sweep (the kernel's
out-of-memory killer sends SIGKILL) has its points run again on a fresh worker, and the sweep gives the rows of an
undisturbed one; a point whose worker dies twice (MAX_ATTEMPTS) fails the sweep with one line naming the point
and how the worker died. A grid over `max_points` points (DEFAULT_MAX_POINTS, 10,000) is refused before any point
is made; a sweep times its first points on its workers, gives the caller the estimate of its wall time
(`on_estimate(Estimate)`), refuses the rest when that is over `time_limit_s` (DEFAULT_TIME_LIMIT_S, 1 h; None: no
limit), and stops its workers once it runs past it. A cluster address is read strictly and probed before ray or
dask gets it, and a cluster's start or connection is bounded in time. Each of these failures is a ConfigError
(one line, the CLI's exit 2), raised from `run_sweep`: nothing is returned, so nothing is written.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import time
from collections.abc import Callable

from .. import deadline as dl
from ..models.config import ConfigError
from ..progress import progress as _progress  # (tests count its advances: sweep._progress)
from ..scenario import Scenario, parse_value
from .address import parse_address
from .bounds import DEFAULT_MAX_POINTS, DEFAULT_TIME_LIMIT_S, Bounds, Estimate, Tracker, check_count, count_points
from .engines import ENGINES as _ENGINE_RUNS
from .output import result_columns, to_csv, to_json, write
from .point import COLUMNS, DEADLINE_COLUMNS, DESCRIBE, SweepPoint, describe
from .signals import Interrupts

ENGINES = tuple(_ENGINE_RUNS)
# engine -> (the module it needs, the extra that installs it)
_EXTRAS = {"ray": ("ray", "peakledger[ray]"), "dask": ("distributed", "peakledger[dask]")}


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


def check_engine(engine: str, address: str | None = None, jobs: int | None = None) -> None:
    """Refuse an unknown engine, a missing optional package, an address without a cluster engine and a
    `jobs` that is not a positive integer, before any work."""
    if engine not in ENGINES:
        raise ConfigError("engine", f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError("jobs", f"the number of worker processes must be a positive integer (1, 2, ...), "
                                  f"got {jobs!r}")
    if address is not None:
        if engine == "local":
            raise ConfigError("address", "an existing cluster's address needs engine ray or dask; "
                                         "the local engine runs on this machine's cores")
        if not isinstance(address, str) or not address.strip():
            raise ConfigError("address", f"expected a cluster address (ray: host:port or auto; dask: "
                                         f"tcp://host:port), got {address!r}")
        if jobs is not None:
            raise ConfigError("jobs", "sizes the local cluster a run starts; an existing cluster (address) "
                                      "runs on the workers it has: drop jobs")
        parse_address(engine, address)  # its form, at once (it is probed when the sweep starts)
    if engine in _EXTRAS:
        module, extra = _EXTRAS[engine]
        if importlib.util.find_spec(module) is None:
            raise ConfigError("engine", f"engine {engine} needs the {module} package: pip install '{extra}'")


def run_sweep(base: Scenario, grid: dict[str, list], budget: int | None = None, max_batch: bool = False,
              jobs: int | None = None, progress: bool = True, engine: str = "local",
              address: str | None = None, deadline: dl.DeadlineBudget | None = None,
              max_points: int = DEFAULT_MAX_POINTS, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
              on_estimate: Callable[[Estimate], None] | None = None) -> list[SweepPoint]:
    """Simulate every grid point on `engine` (see the module docstring); results in grid order. With `deadline`
    each point has the deadline columns and its `deadline_rank` among the points (peakledger/deadline.py).
    `max_points`: a grid with more points is refused before any work; `time_limit_s`: the sweep's wall time at
    most (None: no limit), refused from the estimate or stopped past it; `on_estimate(Estimate)` is called once,
    before the bulk of the work, with the estimate of the sweep's wall time (Estimate.line() is one line for
    stderr)."""
    started = time.monotonic()
    check_engine(engine, address, jobs)
    bounds = Bounds(max_points=max_points, time_limit_s=time_limit_s)
    if on_estimate is not None and not callable(on_estimate):
        raise ConfigError("on_estimate", f"expected a function of an Estimate, got {type(on_estimate).__name__}")
    if deadline is not None and not isinstance(deadline, dl.DeadlineBudget):
        raise ConfigError("deadline", f"expected a DeadlineBudget, got {type(deadline).__name__}")
    if deadline is not None and deadline.memory_bytes is not None:
        if budget is not None and budget != deadline.memory_bytes:
            raise ConfigError("budget", f"two memory budgets: {budget} bytes and the deadline's {deadline.memory_bytes}"
                                        "; give one")
        budget = deadline.memory_bytes
    if max_batch and budget is None and deadline is None:
        raise ConfigError("budget", "--max-batch needs --budget")
    unknown = sorted(set(grid) - base.settings())
    if unknown:  # a misspelt field is an error, not a grid of error rows
        raise ConfigError("grid", f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(base.settings()))}")
    check_count(grid, bounds.max_points)  # from the value lists' lengths, before any point is made
    dl.check_sweep(base, grid, budget, deadline, max_batch)  # a deadline's budget and passes, before any work
    pts = points(grid)
    tasks = [(base, p, budget, max_batch, deadline) for p in pts]
    if not tasks:
        return []
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    run = _ENGINE_RUNS[engine]
    with Interrupts(), _progress("simulating the grid", total=len(tasks), enabled=progress) as bar:
        tracker = Tracker(len(tasks), bounds, bar, on_estimate, started=started)
        results = run(tasks, workers, address, tracker)
    if deadline is not None:  # the ranking needs every point: here, once they are all back, on every engine
        for place, i in enumerate(dl.rank_points(results), start=1):
            results[i]["deadline_rank"] = place
    return [SweepPoint(values=p, result=r) for p, r in zip(pts, results)]


__all__ = ["parse_grid", "points", "count_points", "run_sweep", "check_engine", "to_csv", "to_json", "write",
           "describe", "result_columns", "SweepPoint", "COLUMNS", "DESCRIBE", "DEADLINE_COLUMNS", "ENGINES",
           "DEFAULT_MAX_POINTS", "DEFAULT_TIME_LIMIT_S", "Estimate"]
