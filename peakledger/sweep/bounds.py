"""A sweep's bounds: how many points it may have, how long it may run, and the estimate it makes before the work.

- Points: a grid is the product of its value lists, so a few fields of a hundred values each make 10^8 points.
  The count is that product, computed from the lists' lengths before any point is made (`count_points`); a grid
  over `max_points` (DEFAULT_MAX_POINTS unless the caller says otherwise; the CLI's `--max-points N`) is refused
  with the count, the bound and how to raise it.
- Wall time: a sweep stops once it has run `time_limit_s` (DEFAULT_TIME_LIMIT_S; the CLI's `--time-limit`; None:
  no limit), counted from the start of `run_sweep`, a cluster's start included. Before the bulk of the work the
  engine times its first points (PROBE_PER_WORKER on each worker, those rows are kept) and the `Estimate` of the
  whole run (the elapsed time + the remaining points x the median time of a timed point / the workers) goes to
  the caller's callback; an estimate over the limit refuses the rest of the work at once. Past the limit during
  the run the workers are stopped and the sweep fails with how many points were done. Either way nothing is
  returned, so nothing is written. The estimate is made from the grid's first points, often its cheapest (the
  smallest micro-batch, the shortest sequence): the limit, enforced during the run, is what bounds the time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..analysis.units import format_duration  # (re-exported: read as every duration)
from ..models.config import ConfigError

DEFAULT_MAX_POINTS = 10_000  # points in a grid at most, unless raised (a tiny model's point: ~10 ms and ~2 KB)
DEFAULT_TIME_LIMIT_S = 3600.0  # a sweep's wall time at most, unless raised (None: no limit)
PROBE_PER_WORKER = 2  # points each worker runs, timed, before the estimate (the first one warms the worker up)


@dataclass(frozen=True)
class Bounds:
    """What a sweep may do: `max_points` points at most, `time_limit_s` seconds of wall time at most (None:
    unlimited)."""

    max_points: int = DEFAULT_MAX_POINTS
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S

    def __post_init__(self) -> None:
        if isinstance(self.max_points, bool) or not isinstance(self.max_points, int) or self.max_points < 1:
            raise ConfigError("max_points", f"the most points a sweep may have must be a positive integer, "
                                            f"got {self.max_points!r}")
        t = self.time_limit_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t <= 0):
            raise ConfigError("time_limit", f"a sweep's time limit must be a number of seconds > 0 (or None: no "
                                            f"limit), got {t!r}")


@dataclass(frozen=True)
class Estimate:
    """A sweep's expected wall time, from its first points timed on its workers."""

    points: int  # in the grid
    workers: int  # running them
    timed: int  # points timed for it (their rows are kept)
    per_point_s: float  # the median time of a timed point
    elapsed_s: float  # since the sweep started (the cluster's start and the timed points)
    total_s: float  # expected wall time of the whole sweep: elapsed + the rest over the workers
    time_limit_s: float | None

    @property
    def over_limit(self) -> bool:
        return self.time_limit_s is not None and self.total_s > self.time_limit_s

    def line(self) -> str:
        """One line for stderr, e.g. `sweep: 40,000 points at about 7.1 ms each on 2 workers: about 2 min 22 s
        (time limit 1 h)`."""
        limit = "no time limit" if self.time_limit_s is None else f"time limit {format_duration(self.time_limit_s)}"
        return (f"sweep: {self.points:,} points at about {format_duration(self.per_point_s)} each on "
                f"{self.workers} worker{'s' if self.workers != 1 else ''}: about {format_duration(self.total_s)} "
                f"({limit})")


def count_points(grid: dict[str, Sequence]) -> int:
    """The number of points of `grid` (the product of its value lists' lengths), without making any."""
    return math.prod(len(values) for values in grid.values())


def check_count(grid: dict[str, Sequence], max_points: int) -> int:
    """The grid's point count, or ConfigError("grid") when it is over `max_points`."""
    n = count_points(grid)
    if n > max_points:
        sizes = " x ".join(f"{len(v):,} {k}" for k, v in grid.items())
        raise ConfigError("grid", f"{n:,} points ({sizes}) is over the bound of {max_points:,} points a sweep may "
                                  f"have; make the grid smaller or raise the bound with --max-points {n} "
                                  "(run_sweep's max_points)")
    return n


def estimate(points: int, done: int, seconds: Sequence[float], workers: int, elapsed_s: float,
             time_limit_s: float | None) -> Estimate:
    """The Estimate of a sweep of `points` with `done` of them back after `elapsed_s`, `seconds` the times of
    the timed points (at least one)."""
    per = statistics.median(seconds)
    total = elapsed_s + (points - done) * per / max(1, workers)
    return Estimate(points=points, workers=workers, timed=len(seconds), per_point_s=per, elapsed_s=elapsed_s,
                    total_s=total, time_limit_s=time_limit_s)


class Tracker:
    """A running sweep's account: the points back, the progress bar, the clock against the time limit and the
    estimate. Made by run_sweep, used by the engine that runs the points; `clock` is time.monotonic (tests may
    give another)."""

    def __init__(self, points: int, bounds: Bounds, bar, on_estimate: Callable[[Estimate], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, started: float | None = None) -> None:
        self.points = points
        self.bounds = bounds
        self.bar = bar
        self.on_estimate = on_estimate
        self.clock = clock
        self.started = clock() if started is None else started
        self.done = 0
        self.estimate: Estimate | None = None

    @property
    def wants_estimate(self) -> bool:
        return self.on_estimate is not None or self.bounds.time_limit_s is not None

    def probe_size(self, workers: int) -> int:
        """How many of the first points are timed before the others are sent (0: none, nobody needs it)."""
        return min(self.points, PROBE_PER_WORKER * max(1, workers)) if self.wants_estimate else 0

    def probe_spans(self, workers: int) -> list[range]:
        """The probe points (`probe_size`) as one range per worker (none when nobody needs an estimate)."""
        probe = self.probe_size(workers)
        per = -(-probe // workers) if probe else 1
        return [range(i, min(probe, i + per)) for i in range(0, probe, per)]

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.bar.advance(n)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def check(self) -> None:
        """ConfigError("time_limit") once the sweep has run past its time limit."""
        limit = self.bounds.time_limit_s
        if limit is not None and self.elapsed() > limit:
            raise ConfigError("time_limit", f"the sweep ran past its time limit of {format_duration(limit)} with "
                                            f"{self.done:,} of {self.points:,} points done; nothing written; raise "
                                            "the limit with --time-limit (run_sweep's time_limit_s) or make the grid "
                                            "smaller")

    def estimated(self, seconds: Sequence[float], workers: int) -> Estimate:
        """The estimate from the timed points' `seconds`, given to the caller; ConfigError("time_limit") when it is
        over the limit (the rest of the work is refused)."""
        self.estimate = estimate(self.points, self.done, seconds, workers, self.elapsed(), self.bounds.time_limit_s)
        if self.on_estimate is not None:
            self.on_estimate(self.estimate)
        if self.estimate.over_limit:
            e = self.estimate
            raise ConfigError("time_limit", f"the sweep would take about {format_duration(e.total_s)} ({e.points:,} "
                                            f"points at about {format_duration(e.per_point_s)} each on {e.workers} "
                                            f"worker{'s' if e.workers != 1 else ''}), over its time limit of "
                                            f"{format_duration(e.time_limit_s)}; refused after {self.done:,} points; "
                                            "nothing written; raise the limit with --time-limit (run_sweep's "
                                            "time_limit_s), give more workers (--jobs) or make the grid smaller")
        self.check()
        return self.estimate


__all__ = ["DEFAULT_MAX_POINTS", "DEFAULT_TIME_LIMIT_S", "PROBE_PER_WORKER", "Bounds", "Estimate", "Tracker",
           "count_points", "check_count", "estimate", "format_duration"]
