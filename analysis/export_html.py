"""A run as one self-contained HTML page (`simulate --html`, `explain --html`): the headline (model, setup, peak,
the verdict against a card), an interactive timeline of the peak rank's device memory, the ledger at the peak, the
peak of every phase and, where the caller gives them, the fixes. Inline CSS, inline JavaScript and inline SVG
(analysis/export_html_page.py), the run embedded as JSON: nothing is fetched, the file opens offline.

Every size is written by analysis/units.py `format_bytes` (the page's script has a copy that writes the same
text), and the tables are the text report's own cells (analysis/report_text.py `setup_lines`, `peak_lines`,
`ledger_table`; analysis/phases.py `phase_table`; the fixes as the caller's `explain` prints them).

The timeline is embedded compactly: one entry per tensor (the event indices it is live between, its bytes, its
category and its name, names and op names listed once), each event's op and time, the reserved bytes where they
change, and the phase bands. The page rebuilds each category's bytes after every event from the tensors and lists
the tensors live at the pointer by scanning them, so the file grows with the number of events, never with events x
tensors live. Deterministic: the same run gives the same bytes (no time stamp, no random id).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

from ..simulator.device_memory import DeviceMemory
from ..simulator.events import Action, Phase
from ..simulator.timeline import Timeline
from .device import context_of, device_lines
from .export_html_page import SCRIPT, STYLE
from .ledger import LedgerRow
from .palette import BUDGET_COLOUR, CATEGORY_COLOURS, PHASE_COLOURS, PHASE_SHORT, STACK_ORDER
from .phases import PHASE_WORDS, phase_table
from .report import Report, assumptions, run_plan
from .report_text import ledger_table, peak_lines, setup_lines
from .units import SMALLER, UNITS, format_bytes

TOP_TENSORS = 12  # the pointer's moment lists this many of its live tensors, the largest first
Table = tuple[str, list[str], list[list[str]]]  # a title, the column heads, one row of cells a line


def timeline_data(tl: Timeline, gpu: DeviceMemory | None = None) -> dict:
    """The timeline as the page's script reads it (see the module's docstring). `gpu`: the same rank through the
    caching allocator with its series (Report.gpu_series); its reserved bytes are drawn when they cover every
    event of the timeline."""
    names: dict[str, int] = {}
    name_id = lambda text: names.setdefault(text, len(names))  # noqa: E731
    cats = [c for c in STACK_ORDER if c in tl.by_category]
    cat_id = {c: k for k, c in enumerate(cats)}
    n = len(tl.events)
    opened: dict[int, int] = {}
    starts, ends, sizes, kinds, tensor_names, ops, times = [], [], [], [], [], [], []
    last_ns = 0
    for i, e in enumerate(tl.events):
        b = e.block
        if e.action is Action.ALLOC:
            opened[b.id] = len(starts)
            starts.append(i)
            ends.append(n)
            sizes.append(b.nbytes)
            kinds.append(cat_id[b.category])
            tensor_names.append(name_id(b.name))
        elif b.id in opened:
            ends[opened.pop(b.id)] = i
        ops.append(name_id(e.op))
        ns = round(e.time * 1e9)
        times.append(ns - last_ns)
        last_ns = ns
    series = gpu.series if gpu is not None and len(gpu.series) == n else None
    reserved = None
    if series is not None:
        reserved, before = [], None
        for i, (_, _, r) in enumerate(series):
            if r != before:
                reserved.append([i, r])
                before = r
    return {"n": n, "rank": tl.rank, "names": list(names),
            "cats": [{"name": c.value, "colour": CATEGORY_COLOURS[c]} for c in cats],
            "blocks": {"start": [s - p for s, p in zip(starts, [0] + starts[:-1])],
                       "len": [e - s for s, e in zip(starts, ends)], "size": sizes, "cat": kinds,
                       "name": tensor_names},
            "ops": ops, "t_ns": times, "reserved": reserved,
            "outside": gpu.outside_total if series is not None else None, "bands": phase_bands(tl),
            "phase_colours": {p.value: c for p, c in PHASE_COLOURS.items()}}


def phase_bands(tl: Timeline) -> list[list]:
    """The runs of events of one step and phase (and micro-batch, when a step has several): [first index, index
    after the last, phase, label, short label]."""
    several = any(e.micro_batch_index > 0 for e in tl.events)
    bands: list[list] = []
    key = None
    for i, e in enumerate(tl.events):
        mb = e.micro_batch_index if several and e.phase in (Phase.FORWARD, Phase.BACKWARD) else -1
        if (e.step, e.phase, mb) != key:
            key = (e.step, e.phase, mb)
            label = "load" if e.phase is Phase.LOAD else f"step {e.step} {PHASE_WORDS[e.phase]}"
            label += f" (micro-batch {mb})" if mb >= 0 else ""
            short = PHASE_SHORT[e.phase] + ("" if e.phase is Phase.LOAD else f" {e.step}")
            bands.append([i, i + 1, e.phase.value, label, short])
        else:
            bands[-1][1] = i + 1
    return bands


def page_data(r: Report, unit: str, budget: int | None) -> dict:
    tl = r.timeline
    oom = None
    if r.log.ooms:  # the first OOM's allocation, where the timeline has it
        seq = r.log.ooms[0].event.seq
        oom = next((i for i, e in enumerate(tl.events) if e.seq == seq), None)
    return {**timeline_data(tl, r.gpu_series), "unit": unit, "units": {"scale": UNITS, "smaller": SMALLER},
            "peak": {"index": r.peaks.overall.index, "bytes": r.peaks.overall.bytes}, "budget": budget,
            "budget_colour": BUDGET_COLOUR, "oom": oom, "top": TOP_TENSORS}


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _table(head: list[str], body: list[list[str]], numeric: set[int], table_id: str, cell_class=None,
           row_class=None) -> str:
    """A table of text cells; `numeric`: the columns aligned right; `cell_class(column, text)` and
    `row_class(cells)`: a class for a cell, a row ("" for none)."""
    def cell(tag: str, k: int, text: str) -> str:
        classes = " ".join(x for x in ("num" if k in numeric else "", cell_class(k, text) if cell_class else "") if x)
        return f"<{tag}" + (f' class="{classes}"' if classes else "") + f">{_e(text)}</{tag}>"

    rows = ["<tr>" + "".join(cell("th", k, h) for k, h in enumerate(head)) + "</tr>"]
    for cells in body:
        cls = row_class(cells) if row_class else ""
        rows.append("<tr" + (f' class="{cls}"' if cls else "") + ">"
                    + "".join(cell("td", k, c) for k, c in enumerate(cells)) + "</tr>")
    return f'<table id="{table_id}">' + "".join(rows) + "</table>"


def _card(key: str, value: str, words: str, cls: str = "", value_id: str = "") -> str:
    ident = f' id="{value_id}"' if value_id else ""
    return (f'<div class="card {cls}"><div class="k">{_e(key)}</div><div class="v"{ident}>{_e(value)}</div>'
            f'<div class="w">{_e(words)}</div></div>')


def _headline(r: Report, unit: str, verdict: tuple[bool, str] | None, notes: Sequence[str]) -> str:
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    setup = setup_lines(r)
    pk = r.peaks.overall
    e = pk.event
    where = f"at {e.op} ({e.phase.value}, step {e.step})" if e is not None else "no memory events"
    cards = [_card("true peak (allocated)", f(pk.bytes), where, value_id="peak-value")]
    if r.gpu is not None:
        cards.append(_card("device total", f(r.gpu.total_peak.total),
                           f"reserved peak {f(r.gpu.reserved_peak.reserved)} + outside the caching allocator "
                           f"{f(r.gpu.outside_total)}", value_id="device-total-value"))
    if verdict is not None:
        fits, line = verdict
        cards.append(_card("on the card", "fits" if fits else "does not fit", line, "fits" if fits else "over",
                           value_id="verdict-value"))
    return (f"<h1>{_e(setup[0])}</h1>"
            + (f'<p class="sub">{_e(setup[1].strip())}</p>' if len(setup) > 1 else "")
            + '<div class="cards">' + "".join(cards) + "</div>"
            + (f'<ul class="notes">{"".join(f"<li>{_e(x)}</li>" for x in notes)}</ul>' if notes else ""))


def _details_section(r: Report, unit: str) -> str:
    """The text report's setup, peak and GPU lines as they are."""
    gpu = device_lines(r.gpu, unit, context_of(r.log)) if r.gpu is not None else []
    lines = [x.strip() for x in setup_lines(r)[2:]] + [""] + peak_lines(r, unit) + [""] + gpu
    return (f'<section id="details"><h2>Setup, peaks and the GPU</h2><pre>{_e(chr(10).join(lines).strip())}</pre>'
            "</section>")


def _timeline_section(r: Report, unit: str, budget: int | None) -> str:
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    live = r.peaks.overall.live_by_category
    items = [f'<span><span class="swatch" style="background:{CATEGORY_COLOURS[c]}"></span>'
             f"{_e(c.value.replace('_', ' '))} {_e(f(live.get(c, 0)))}</span>"
             for c in STACK_ORDER if c in r.timeline.by_category]
    if r.gpu_series is not None:
        items += ['<span><span class="line"></span>reserved</span>',
                  '<span><span class="line" style="border-top-style:dotted"></span>device total</span>']
    if budget is not None:
        items.append(f'<span><span class="line" style="border-top:2px dashed {BUDGET_COLOUR}"></span>'
                     f'budget {_e(f(budget))}<span id="budget-note"></span></span>')
    plan = run_plan(r.log)
    steps = plan.summary() or f"{r.steps} step{'s' if r.steps != 1 else ''}"
    return ('<section id="timeline"><h2>Device memory of rank ' + _e(r.peaks.rank) + " over the run (" + _e(steps)
            + ")</h2>"
            '<div class="toolbar"><button id="reset-zoom" type="button">whole run</button><span id="view-status">'
            '</span><span>wheel: zoom &middot; drag: zoom to a range &middot; double-click: whole run &middot; '
            'the pointer: the tensors live at that moment</span></div>'
            f'<div class="legend">{"".join(items)}<span>(bytes of each category at the peak)</span></div>'
            '<svg id="chart" role="img" aria-label="device memory over the run"></svg></section>')


def _ledger_section(rows: list[LedgerRow], unit: str | None) -> str:
    title, head, body = ledger_table(rows, unit)
    return (f"<section id=\"ledger\"><h2>{_e(title[0].upper() + title[1:])}</h2>"
            + _table(head, body, {1, 3, 4, 5, 6}, "ledger-table",
                     row_class=lambda c: "total" if c[0] == "total" else "") + "</section>")


def _phases_section(r: Report, unit: str, budget: int | None) -> str:
    if not r.phases:
        return ""
    title, head, body = phase_table(r.phases, unit, budget)
    numeric = set(range(1, len(head) - 1))
    return (f'<section id="phases"><h2>{_e(title.rstrip(":"))}</h2>'
            + _table(head, body, numeric, "phases-table", cell_class=lambda k, text: "over" if head[k] == "margin"
                     and text.startswith(("-", ">-")) else "") + "</section>")


def _fixes_section(fixes: Table | None) -> str:
    if fixes is None:
        return ""
    title, head, body = fixes
    fits = head.index("fits") if "fits" in head else -1
    table = _table(head, body, {1, 3}, "fixes-table",
                   cell_class=lambda k, text: text if k == fits and text in ("yes", "no") else "") if body else ""
    return f'<section id="fixes"><h2>Fixes</h2><p>{_e(title)}</p>{table}</section>'


def html_report(r: Report, unit: str | None = None, budget: int | None = None,
                verdict: tuple[bool, str] | None = None, fixes: Table | None = None, notes: Sequence[str] = ()) -> str:
    """The page of `r`: `budget` draws a line and the phases' margins; `verdict` (fits, its line) is the run held
    against a card; `fixes` (title, heads, rows of cells, as `explain` prints them) adds the fixes section (absent
    when None); `notes`: lines under the headline (explain's where and why). `unit`: the tables' (else each its
    largest value's) and the sizes written in the page (else GiB)."""
    tables, unit = unit, unit or "GiB"
    data = json.dumps(page_data(r, unit, budget), separators=(",", ":"), ensure_ascii=True).replace("<", "\\u003c")
    listed = assumptions(r)
    plan = run_plan(r.log)
    events = (f"{len(r.log.events):,} events" if not plan.truncated else
              f"{len(r.log.events):,} events simulated ({plan.summary()})")
    body = (_headline(r, unit, verdict, notes) + _timeline_section(r, unit, budget) + _ledger_section(r.ledger, tables)
            + _phases_section(r, tables, budget) + _fixes_section(fixes) + _details_section(r, unit)
            + ('<section id="assumptions"><h2>Assumptions</h2><ul class="notes">'
               + "".join(f"<li>{_e(a)}</li>" for a in listed) + "</ul></section>" if listed else "")
            + f"<footer>{_e(events)}; written by peakledger</footer>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>peakledger: {_e(r.name)}</title><style>{STYLE}</style></head><body><main>{body}</main>"
            '<div id="tooltip" role="tooltip"></div>'
            f'<script type="application/json" id="peakledger-data">{data}</script>'
            f"<script>{SCRIPT}</script></body></html>\n")


__all__ = ["html_report", "timeline_data", "phase_bands", "page_data", "TOP_TENSORS"]
