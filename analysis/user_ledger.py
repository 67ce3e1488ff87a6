"""The ledger, the peak and the timeline of a user's own events (`peakledger ledger EVENTS`; the file, its checks and
the `UserLog` it becomes: analysis/user_events.py): for each (rank, pool) of the log its timeline
(simulator/timeline.py), its peak, the ledger there (analysis/ledger.py) and the objects live there; the timeline as
one row per event, and as CSV."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from ..simulator.events import Block
from ..simulator.timeline import PeakPoint, Timeline, timeline
from .ledger import LedgerRow, ledger_at
from .user_events import UserLog, time_text


@dataclass(frozen=True)
class LiveBlock:
    block: Block
    storage: str | None
    objects: tuple[str, ...]


@dataclass(frozen=True)
class PoolLedger:
    """One (rank, pool) of a user log: its timeline, its peak (the first moment of the highest occupancy), the
    ledger there and what is live there, largest first."""

    timeline: Timeline
    peak: PeakPoint
    row: int  # the input event right after which the peak is reached (an index into UserLog.rows)
    ledger: list[LedgerRow]
    live: list[LiveBlock]


def pool_ledgers(u: UserLog) -> list[PoolLedger]:
    out = []
    for rank, pool in u.log.pools():
        tl = timeline(u.log, rank, pool)
        peak = tl.peak()
        row = u.event_rows[peak.event.seq]
        objects = u.live_objects(row)
        live = [LiveBlock(b, u.storages[b.id], tuple(objects[b.id])) for b in tl.live_blocks_at(peak.index)]
        live.sort(key=lambda x: (-x.block.nbytes, x.block.id))
        out.append(PoolLedger(tl, peak, row, ledger_at(tl, peak.index), live))
    return out


def timeline_rows(u: UserLog, pl: PoolLedger, start: int = 0, stop: int | None = None) -> list[dict]:
    """One dict per event of the pool's timeline (events `start` to `stop`; all by default): the input event that
    caused it and the bytes live after it, in all and by category."""
    tl = pl.timeline
    out = []
    for i, e in enumerate(tl.events[start:stop], start):
        row = u.event_rows[e.seq]
        r = u.rows[row]
        out.append({"time": e.time, "event": row + 1, "where": r.where, "action": e.action.value, "object": r.object,
                    "storage": u.storages[e.block.id], "category": e.block.category.value, "delta": e.delta,
                    "bytes": int(tl.total[i]),
                    "by_category": {c.value: int(v[i]) for c, v in tl.by_category.items()}})
    return out



def timeline_csv(u: UserLog, pl: PoolLedger) -> bytes:
    """The pool's timeline as CSV: one line per event (columns time, event, where, action, object, storage,
    category, delta_bytes, live_bytes, then the bytes live of each category the pool has, `<category>_bytes`)."""
    cats = [c.value for c in pl.timeline.by_category]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["time", "event", "where", "action", "object", "storage", "category", "delta_bytes", "live_bytes",
                *(f"{c}_bytes" for c in cats)])
    for r in timeline_rows(u, pl):
        w.writerow([time_text(r["time"]), r["event"], r["where"], r["action"], r["object"], r["storage"] or "",
                    r["category"], r["delta"], r["bytes"], *(r["by_category"][c] for c in cats)])
    return buf.getvalue().encode()


__all__ = ["PoolLedger", "LiveBlock", "pool_ledgers", "timeline_rows", "timeline_csv"]
