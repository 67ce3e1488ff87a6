"""`peakledger ledger EVENTS`: the ledger, the peak and the timeline of your own list of allocate / free events.

    peakledger ledger examples/events/shared-storage.csv
    peakledger ledger events.json --json --plot occupancy.png --export-timeline timeline.csv

EVENTS is CSV or JSON (analysis/user_events.py says the format and the checks): each event has a time, an object,
bytes and an action (alloc / free), optionally a storage id (objects sharing one storage count its bytes once, while
any of them lives), a category, a pool, a rank and a phase. Events apply in file order: times never decrease, and
events at the same time apply in the order the file lists them. They become the project's event log, so the
timeline, ledger and peak are the simulator's own code (simulator/timeline.py, analysis/ledger.py), and the plot
analysis/plot.py's. Every (rank, pool) in the file is reported (`--rank` / `--pool` choose one); the plot and the
timeline export draw one, so with several in the file they need the choice. Bad input exits 2 with one line naming
the file, the row and the column.
"""

from __future__ import annotations

import argparse
import warnings

from .analysis.ledger import row_name
from .analysis.units import Scale, auto_unit, format_bytes
from .analysis.user_events import ORDER_RULE, UserLog, read_user_events
from .analysis.user_ledger import PoolLedger, pool_ledgers, timeline_csv, timeline_rows
from .cli_common import flag_int, write_json
from .simulator.events import Pool
from .simulator.safe_io import InputError, check_outputs, write_atomic

TEXT_TIMELINE_ROWS = 60  # the text report's timeline shows at most this many events (around the peak)
TEXT_LIVE_ROWS = 20  # and at most this many live blocks


def cmd_ledger(args) -> int:
    check_outputs({"--plot": args.plot, "--export-timeline": args.export_timeline}, {"EVENTS": args.events})
    if args.rank is not None and args.rank < 0:
        raise InputError("--rank", f"must be an integer >= 0, got {args.rank}")
    u = read_user_events(args.events)
    pools = _chosen(args, pool_ledgers(u))
    if (args.plot or args.export_timeline) and len(pools) > 1:
        raise InputError("--plot" if args.plot else "--export-timeline",
                         f"{u.path} has {len(pools)} (rank, pool) timelines ({_names(pools)}); the plot and the "
                         "timeline export draw one: choose it with --rank and --pool")
    if args.plot:
        from .analysis.plot import plot_timeline  # matplotlib, loaded for the picture only

        pl = pools[0]
        with warnings.catch_warnings():  # (matplotlib's on a list whose events share one instant: a zero-width axis)
            warnings.simplefilter("ignore", UserWarning)
            plot_timeline(pl.timeline, args.plot, unit=args.unit or auto_unit(pl.peak.bytes),
                          title=f"{u.path}: rank {pl.timeline.rank} {pl.timeline.pool.value} memory by category")
    if args.export_timeline:
        write_atomic(args.export_timeline, timeline_csv(u, pools[0]))
    if args.json:
        write_json(ledger_json(u, pools))
        return 0
    print("\n".join(ledger_text(u, pools, args.unit)))  # (no --unit: each pool's peak's)
    written = [x for x in (args.plot, args.export_timeline) if x]
    if written:
        print(f"written: {', '.join(written)}")
    return 0


def _names(pools: list[PoolLedger]) -> str:
    return ", ".join(f"rank {p.timeline.rank} {p.timeline.pool.value}" for p in pools)


def _chosen(args, pools: list[PoolLedger]) -> list[PoolLedger]:
    chosen = [p for p in pools if (args.rank is None or p.timeline.rank == args.rank)
              and (args.pool is None or p.timeline.pool.value == args.pool)]
    if not chosen:
        flags = " ".join(f"--{n} {getattr(args, n)}" for n in ("rank", "pool") if getattr(args, n) is not None)
        raise InputError("--rank" if args.rank is not None else "--pool",
                         f"{args.events} has no events in {flags}; it has {_names(pools)}")
    return chosen


def _block_json(u: UserLog, pl: PoolLedger) -> list[dict]:
    return [{"storage": x.storage, "objects": list(x.objects), "bytes": x.block.nbytes,
             "category": x.block.category.value, "state": x.block.state.value if x.block.state else None}
            for x in pl.live]


def ledger_json(u: UserLog, pools: list[PoolLedger]) -> dict:
    out = []
    for pl in pools:
        row = u.rows[pl.row]
        e = pl.peak.event
        out.append({"rank": pl.timeline.rank, "pool": pl.timeline.pool.value,
                    "peak": {"bytes": pl.peak.bytes, "time": e.time, "event": pl.row + 1, "where": row.where,
                             "action": row.action.value, "object": row.object, "storage": u.storages[e.block.id],
                             "live_by_category": {c.value: b for c, b in pl.peak.live_by_category.items()}},
                    "ledger": [{"row": r.row, "category": r.category.value, "bytes": r.bytes, "blocks": r.tensors,
                                "share": round(r.share, 6), "max_bytes": r.max_bytes} for r in pl.ledger],
                    "live": _block_json(u, pl), "timeline": timeline_rows(u, pl)})
    return {"events_file": u.path, "format": u.kind, "order": ORDER_RULE, "unit": "B", "events": len(u.rows),
            "objects": u.objects, "blocks": len(u.storages), "pools": out}


def _time(t: float) -> str:
    return str(int(t)) if t.is_integer() and abs(t) < 2**53 else repr(t)


def ledger_text(u: UserLog, pools: list[PoolLedger], unit: str | None) -> list[str]:
    """The text: per pool its peak, the ledger, what is live and the timeline around the peak, every size of a pool
    in one unit (`unit`, else the pool's peak's: analysis/units.py Scale), named in each table's head."""
    lines = [f"{u.path}: {len(u.rows)} events, {u.objects} objects, {len(u.storages)} blocks of memory (the objects "
             "that share a storage are one block, counted once)", f"order: {ORDER_RULE}"]
    for pl in pools:
        row = u.rows[pl.row]
        g = Scale.of([pl.peak.bytes] + [r.max_bytes for r in pl.ledger], unit)
        f = g.number
        lines += ["", f"rank {pl.timeline.rank} {pl.timeline.pool.value} memory: peak "
                      f"{format_bytes(pl.peak.bytes, g.unit)} at time "
                      f"{_time(row.time)} ({row.where}: {row.action.value} {row.object})",
                  f"  {'ledger at the peak':<34}{g.unit:>14}{'share':>8}{'blocks':>8}  highest over the run "
                  f"({g.unit})"]
        for r in pl.ledger:
            lines.append(f"  {r.row:<34}{f(r.bytes):>14}{r.share:>8.1%}{r.tensors:>8}  {f(r.max_bytes)}")
        lines.append(f"  {'total':<34}{f(pl.peak.bytes):>14}")
        lines.append(f"  live at the peak (largest first; {g.unit}):")
        for x in pl.live[:TEXT_LIVE_ROWS]:
            name = ", ".join(x.objects) if x.storage is None else f"storage {x.storage}: {', '.join(x.objects)}"
            lines.append(f"    {f(x.block.nbytes):>12}  {row_name(x.block):<26}{name}")
        if len(pl.live) > TEXT_LIVE_ROWS:
            lines.append(f"    ... and {len(pl.live) - TEXT_LIVE_ROWS} more (--json lists them all)")
        lines += _timeline_text(u, pl, g)
    return lines


def _timeline_text(u: UserLog, pl: PoolLedger, g: Scale) -> list[str]:
    n, peak = len(pl.timeline.events), pl.peak.index
    start = max(0, min(peak - TEXT_TIMELINE_ROWS // 2, n - TEXT_TIMELINE_ROWS))
    shown = timeline_rows(u, pl, start, start + TEXT_TIMELINE_ROWS)
    lines = [f"  timeline ({g.unit} live after each alloc or free of a block; the alloc or free of a reference to a "
             "storage another object holds changes nothing):",
             f"    {'time':>10}  {'event':>6}  {'action':<6} {'object':<30}{'change':>14}{'live':>14}"]
    if start:
        lines.append(f"    ... {start} earlier")
    for i, r in enumerate(shown, start):
        sign = "+" if r["delta"] >= 0 else ""
        lines.append(f"    {_time(r['time']):>10}  {r['event']:>6}  {r['action']:<6} {r['object']:<30}"
                     f"{sign + g.number(r['delta']):>14}{g.number(r['bytes']):>14}"
                     + ("  <- peak" if i == peak else ""))
    if start + len(shown) < n:
        lines.append(f"    ... {n - start - len(shown)} later (--export-timeline FILE.csv or --json: all)")
    return lines


def register(sub) -> None:
    """Adds the `ledger` sub-command."""
    p = sub.add_parser(
        "ledger", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the ledger, peak and timeline of your own list of alloc / free events (CSV or JSON)",
        description="The ledger (bytes by category at the peak), the peak (time, bytes, what is live) and the "
                    "timeline of your own allocate / free events.",
        epilog="""EVENTS: CSV (a header line, then one row per event) or JSON (a list of objects, or
{"events": [...]}), told by the extension (.csv, .json), else by the first character.
  time      a finite number (seconds or any clock); never decreasing
  object    the tensor's name or id: live from its alloc to its free
  bytes     4096, or with a unit: 4MiB, 1.5KiB, 2GB (may be empty on a free)
  action    alloc or free
  storage   optional: objects naming one storage share its bytes, counted once, live while any is
  category  optional (default unknown): parameter, gradient, master_parameter, optimizer_state
            (or optimizer_state.exp_avg, ...), activation, temporary, input, buffer, ...
            (simulator/events.py's Category values)
  pool      optional (default device): device or host
  rank      optional (default 0): the process or device index
  phase     optional (default load): load, forward, backward, optimizer, zero_grad, checkpoint
ORDER: file order. Events apply in the order the file lists them; events at the same time apply as
listed, so an alloc listed before a free at the same time is live together with the freed object.
CSV lines whose first cell starts with # are comments. Errors exit 2 naming the file, row and column.""")
    p.add_argument("events", metavar="EVENTS", help="the events file (.csv or .json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes; every timeline event)")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of occupancy by category (one rank and pool)")
    p.add_argument("--export-timeline", metavar="FILE.csv",
                   help="write the timeline as CSV: one line per event, bytes live in all and by category")
    p.add_argument("--rank", type=flag_int, help="report this rank only (default: every rank in the file)")
    p.add_argument("--pool", choices=[x.value for x in Pool], help="report this pool only (default: both)")
    p.add_argument("--unit", choices=["B", "KiB", "MiB", "GiB", "KB", "MB", "GB"],
                   help="print sizes in this unit (default: the binary unit of the largest peak); --json gives bytes")
    p.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")
    p.set_defaults(func=cmd_ledger)
