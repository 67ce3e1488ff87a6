"""Occupancy timelines: bytes live after each event, per category, for one (rank, pool).

Built from any `EventLog` (simulated or measured). Python ints decide the peak exactly; the numpy
arrays are for plotting and vector maths (int64, or object dtype if a total would not fit int64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .events import Action, Category, Event, EventLog, Pool
from .log_index import CATEGORIES, LogIndex, first_max, groups, running_sums

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class PeakPoint:
    """The moment a pool's occupancy is highest: the event right after which it was reached."""

    bytes: int
    event: Event | None  # None for an empty log
    live_by_category: dict[Category, int]
    index: int = -1  # position in the timeline's events


@dataclass
class Timeline:
    rank: int
    pool: Pool
    events: list[Event]  # only this pool's events, in order
    times: np.ndarray  # seconds
    total: np.ndarray  # bytes live after each event
    by_category: dict[Category, np.ndarray]

    def peak(self, where=None) -> PeakPoint:
        """Highest occupancy over the events for which `where(event)` holds (all by default).

        Ties go to the earliest event: the first moment the peak is reached.
        """
        best, best_i = -1, -1
        running = 0
        for i, e in enumerate(self.events):
            running += e.delta
            if (where is None or where(e)) and running > best:
                best, best_i = running, i
        if best_i < 0:
            return PeakPoint(bytes=0, event=None, live_by_category={})
        return PeakPoint(bytes=best, event=self.events[best_i], live_by_category=self.live_at(best_i), index=best_i)

    def peak_in(self, mask: np.ndarray | None = None) -> PeakPoint:
        """`peak(where)` for the events selected by a boolean array (`mask[i]`: event i counts; None: all),
        from the totals and by-category columns (int64) instead of a pass over the events; `peak` itself when
        the totals are Python ints (object arrays)."""
        total = self.total
        if total.dtype == object or not len(total):
            return self.peak(None if mask is None else lambda e, it=iter(mask.tolist()): next(it))
        if mask is None:
            i = int(np.argmax(total))
        else:
            chosen = np.flatnonzero(mask)
            if not len(chosen):
                return PeakPoint(bytes=0, event=None, live_by_category={})
            i = int(chosen[np.argmax(total[chosen])])
        best = int(total[i])
        if best < 0:  # `peak` counts only totals from 0 up
            return PeakPoint(bytes=0, event=None, live_by_category={})
        by = self.by_category
        live = {c: int(by[c][i]) for c, first in self.first_seen if first <= i}
        return PeakPoint(bytes=best, event=self.events[i], live_by_category={c: b for c, b in live.items() if b},
                         index=i)

    @functools.cached_property
    def first_seen(self) -> list[tuple[Category, int]]:
        """Each category with the index of its first event, in that order (the order `live_at` meets them); found
        once (the peaks and the ledger each read it)."""
        first: dict[Category, int] = {}
        for i, e in enumerate(self.events):
            c = e.block.category
            if c not in first:
                first[c] = i
                if len(first) == len(self.by_category):
                    break
        return list(first.items())

    def live_at(self, index: int) -> dict[Category, int]:
        """Bytes live by category right after event `index` (exact ints)."""
        live: dict[Category, int] = {}
        for e in self.events[: index + 1]:
            live[e.block.category] = live.get(e.block.category, 0) + e.delta
        return {c: b for c, b in live.items() if b}

    def live_allocs_at(self, index: int) -> list[Event]:
        """The allocation events of the blocks live right after event `index`, in the order they were made."""
        live = {}
        for e in self.events[: index + 1]:
            if e.action is Action.ALLOC:
                live[e.block.id] = e
            else:
                live.pop(e.block.id, None)
        return list(live.values())

    def live_blocks_at(self, index: int) -> list:
        return [e.block for e in self.live_allocs_at(index)]


def rank_peak_points(log: EventLog, pool: Pool = Pool.DEVICE, index: LogIndex | None = None) -> dict[int, PeakPoint]:
    """Every rank's `timeline(log, rank, pool).peak()`, in one pass over the log instead of a timeline per rank:
    each rank's running total and bytes by category, the latter copied whenever the total passes the rank's
    highest so far (ties to the earliest event). `index`: the log's (simulator/log_index.py), read instead."""
    if index is not None:
        return _indexed_peak_points(log, pool, index)
    states: dict[int, list] = {}  # rank -> [total, events seen, best, its index, its event, by category, at best]
    alloc = Action.ALLOC
    last_rank, st, cats = None, None, None
    for e in log.events:
        b = e.block
        if b.pool is not pool:
            continue
        r = b.rank
        if r != last_rank:
            st = states.get(r)
            if st is None:
                st = states[r] = [0, 0, None, -1, None, {}, None]
            last_rank, cats = r, st[5]
        c = b.category
        if e.action is alloc:
            n = b.nbytes
        else:
            n = -b.nbytes
        total = st[0] = st[0] + n
        cats[c] = cats.get(c, 0) + n
        st[1] += 1
        if st[2] is None or total > st[2]:
            st[2], st[3], st[4], st[6] = total, st[1] - 1, e, cats.copy()
    return {r: PeakPoint(bytes=st[2], event=st[4], live_by_category={c: v for c, v in st[6].items() if v},
                         index=st[3])
            if st[2] >= 0 else PeakPoint(bytes=0, event=None, live_by_category={}) for r, st in states.items()}


def _indexed_peak_points(log: EventLog, pool: Pool, index: LogIndex) -> dict[int, PeakPoint]:
    """`rank_peak_points` from the log's index: each rank's running totals (int64, exact: `log_index`), the first
    highest, and the bytes by category up to it, in the order the rank first meets them."""
    sel = index.pool_positions(pool)
    if not len(sel):
        return {}
    order, starts, run = groups(index.rank[sel])
    pos = sel[order]  # the pool's events, rank by rank, each rank's in the log's order
    d = index.delta[pos]
    total = running_sums(d, starts, run)
    best = first_max(total, starts, run)
    cats = index.category[pos]
    place = np.arange(len(pos))
    upto = place <= best[run]
    live, first = {}, {}
    for k in np.unique(cats).tolist():
        mine = cats == k
        live[k] = np.add.reduceat(np.where(upto & mine, d, 0), starts).tolist()
        first[k] = np.minimum.reduceat(np.where(mine, place, len(pos)), starts).tolist()
    out = {}
    events = log.events
    for g, (r, b, s) in enumerate(zip(index.rank[pos[starts]].tolist(), best.tolist(), starts.tolist())):
        top = int(total[b])
        if top < 0:
            out[r] = PeakPoint(bytes=0, event=None, live_by_category={})
            continue
        seen = sorted((first[k][g], k) for k in first if first[k][g] <= b)
        out[r] = PeakPoint(bytes=top, event=events[int(pos[b])], index=b - s,
                           live_by_category={CATEGORIES[k]: live[k][g] for _, k in seen if live[k][g]})
    return out


def _array(values: list[int]) -> np.ndarray:
    if values and (max(values) > INT64_MAX or min(values) < -INT64_MAX):
        return np.array(values, dtype=object)
    return np.array(values, dtype=np.int64)


def rank_events(log: EventLog, rank: int, index: LogIndex | None = None) -> list[tuple[int, Event]]:
    """The events of `rank` (every pool) with their places in the log, in order: one pass over the log that a
    rank's timelines and its allocator replay (simulator/device_memory.py) can share (`index`: looked up in the
    log's index instead)."""
    if index is not None:
        places = index.positions(rank).tolist()
        return list(zip(places, map(log.events.__getitem__, places)))
    return [(i, e) for i, e in enumerate(log.events) if e.block.rank == rank]


def timeline(log: EventLog, rank: int = 0, pool: Pool = Pool.DEVICE,
             events: list[tuple[int, Event]] | None = None, index: LogIndex | None = None) -> Timeline:
    """`rank`'s occupancy of `pool`; `events`: the rank's events if already found (`rank_events`); `index`: the
    log's (simulator/log_index.py), its columns read instead of the events'."""
    if index is not None:
        places = index.positions(rank, pool)
        events = list(map(log.events.__getitem__, places.tolist()))
        d, codes = index.delta[places], index.category[places]
        return Timeline(rank=rank, pool=pool, events=events, times=np.array([e.time for e in events], dtype=float),
                        total=np.cumsum(d), by_category={CATEGORIES[k]: np.cumsum(np.where(codes == k, d, 0))
                                                         for k in np.unique(codes).tolist()})
    if events is None:
        events = [e for e in log.events if e.block.rank == rank and e.block.pool is pool]
    else:
        events = [e for _, e in events if e.block.pool is pool]
    alloc = Action.ALLOC
    deltas = [e.block.nbytes if e.action is alloc else -e.block.nbytes for e in events]
    if events and sum(map(abs, deltas)) <= INT64_MAX:  # no running sum leaves int64: numpy's cumsum, exact
        order = list(Category)
        codes = np.array([order.index(e.block.category) for e in events], dtype=np.int64)
        d = np.array(deltas, dtype=np.int64)
        return Timeline(rank=rank, pool=pool, events=events, times=np.array([e.time for e in events], dtype=float),
                        total=np.cumsum(d), by_category={order[k]: np.cumsum(np.where(codes == k, d, 0))
                                                         for k in np.unique(codes).tolist()})  # in Category order
    categories = sorted({e.block.category for e in events}, key=lambda c: list(Category).index(c))
    running = {c: 0 for c in categories}
    columns: dict[Category, list[int]] = {c: [] for c in categories}
    totals: list[int] = []
    total = 0
    for e in events:
        running[e.block.category] += e.delta
        total += e.delta
        totals.append(total)
        for c in categories:
            columns[c].append(running[c])
    return Timeline(rank=rank, pool=pool, events=events,
                    times=np.array([e.time for e in events], dtype=float),
                    total=_array(totals), by_category={c: _array(v) for c, v in columns.items()})
