"""Two measured sources of the same run, side by side: bytes at each one's peak by category.

Used to show how far torch.profiler's memory timeline and our dispatch tracker agree (they should
agree on bytes to a few scalars; their labels differ where the profiler cannot tell, e.g. optimizer
temporaries it calls UNKNOWN)."""

from __future__ import annotations

from ..simulator.events import Category, EventLog
from ..simulator.timeline import timeline


def agreement(a: EventLog, b: EventLog) -> dict:
    pa, pb = timeline(a).peak(), timeline(b).peak()
    cats = [c for c in Category if pa.live_by_category.get(c) or pb.live_by_category.get(c)]
    return {"peak": (pa.bytes, pb.bytes), "events": (len(a.events), len(b.events)),
            "by_category": {c.value: (pa.live_by_category.get(c, 0), pb.live_by_category.get(c, 0)) for c in cats}}
