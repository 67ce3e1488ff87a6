"""One index of an event log, made once per run and shared by its readers: a column per field they filter or sum
by (rank, pool, signed bytes, category, step), one entry per event, in the log's order.

The report of a run reads the log many times: every rank's peak, the peak rank's events and timelines, each rank's
host memory, each rank's step ends, the ranks present. Each was a pass over every event in Python (a 2,048-rank
pipeline run records about 925,000); with the index each is a few numpy operations over the columns, and the
events themselves are only looked up where a result names one (the event at a peak, a timeline's events).

Exact: the signed bytes are int64 only when no running sum over the log can leave int64 (the sum of every event's
bytes fits); else `log_index` gives None and the readers take their pass over the events, as before. Times are not
a column: a reader that gives a time reads it from the event (the clock starts at the int 0, as SimPy's does).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_

import numpy as np

from .events import Action, Category, EventLog, Pool

INT64_MAX = 2**63 - 1
CATEGORIES = list(Category)  # a category's code is its place here (the order the timelines list them)
POOLS = list(Pool)


@dataclass(frozen=True, eq=False)
class LogIndex:
    """The columns of one log (`log_index`); `rank`, `pool`, `category`, `step` int codes, `delta` the signed bytes
    (+ an allocation, - a free)."""

    rank: np.ndarray  # int64
    pool: np.ndarray  # int8: the place in POOLS
    delta: np.ndarray  # int64
    category: np.ndarray  # int8: the place in CATEGORIES
    step: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.rank)

    def ranks(self) -> list[int]:
        """The ranks with any event, ascending."""
        return np.unique(self.rank).tolist()

    def has_pool(self, pool: Pool) -> bool:
        return bool((self.pool == POOLS.index(pool)).any())

    def positions(self, rank: int, pool: Pool | None = None) -> np.ndarray:
        """The places in the log of `rank`'s events (of `pool` only, given one), in order."""
        mask = self.rank == rank
        if pool is not None:
            mask &= self.pool == POOLS.index(pool)
        return np.flatnonzero(mask)

    def pool_positions(self, pool: Pool) -> np.ndarray:
        return np.flatnonzero(self.pool == POOLS.index(pool))

    def last_of_steps(self) -> list[int]:
        """The place of each (rank, step)'s last event, in the log's order."""
        if not len(self):
            return []
        low = int(self.step.min())
        key = (self.rank - int(self.rank.min())) * (int(self.step.max()) - low + 1) + (self.step - low)
        _, last = np.unique(key[::-1], return_index=True)
        return sorted((len(key) - 1 - last).tolist())

    def step_counts(self) -> dict[int, int]:
        """step -> how many events it holds."""
        steps, counts = np.unique(self.step, return_counts=True)
        return dict(zip(steps.tolist(), counts.tolist()))


def log_index(log: EventLog) -> LogIndex | None:
    """The index of `log`, in one pass over its events per column; None where the bytes could leave int64 (a
    reader then walks the events)."""
    events = log.events
    n = len(events)
    blocks = list(map(attrgetter("block"), events))
    try:
        nbytes = np.fromiter(map(attrgetter("nbytes"), blocks), np.int64, n)
    except OverflowError:
        return None
    if n and int(nbytes.max()) * n > INT64_MAX and sum(nbytes.tolist()) > INT64_MAX:
        return None
    alloc = np.fromiter(map(is_, map(attrgetter("action"), events), repeat(Action.ALLOC)), bool, n)
    pool_code = {p: k for k, p in enumerate(POOLS)}
    cat_code = {c: k for k, c in enumerate(CATEGORIES)}
    return LogIndex(rank=np.fromiter(map(attrgetter("rank"), blocks), np.int64, n),
                    pool=np.fromiter(map(pool_code.__getitem__, map(attrgetter("pool"), blocks)), np.int8, n),
                    delta=np.where(alloc, nbytes, -nbytes),
                    category=np.fromiter(map(cat_code.__getitem__, map(attrgetter("category"), blocks)), np.int8, n),
                    step=np.fromiter(map(attrgetter("step"), events), np.int64, n))


def groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stable sort of `keys` into runs of equal keys: (the order, each run's start in it, each element's run)."""
    small = len(keys) and -(1 << 15) <= int(keys.min()) and int(keys.max()) < 1 << 15
    order = np.argsort(keys.astype(np.int16) if small else keys, kind="stable")  # (int16: numpy's radix sort)
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
    run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(k)]))
    return order, starts, run


def running_sums(values: np.ndarray, starts: np.ndarray, run: np.ndarray) -> np.ndarray:
    """The running sum of `values` within each run (grouped as `groups` made them), exact in int64."""
    total = np.cumsum(values)
    before = (total[starts] - values[starts])[run] if len(values) else total
    return total - before


def first_max(values: np.ndarray, starts: np.ndarray, run: np.ndarray) -> np.ndarray:
    """The place of each run's highest value (its first on ties), in `values`."""
    top = np.maximum.reduceat(values, starts)
    hit = np.flatnonzero(values == top[run])
    _, first = np.unique(run[hit], return_index=True)
    return hit[first]


__all__ = ["CATEGORIES", "LogIndex", "POOLS", "first_max", "groups", "log_index", "running_sums"]
