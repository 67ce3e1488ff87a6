"""A sweep's results as CSV and JSON (same grid, same bytes), written atomically."""

from __future__ import annotations

import csv
import io
import json

from .. import deadline as dl
from ..scenario import Scenario
from ..simulator.safe_io import write_atomic
from .point import COLUMNS, DEADLINE_COLUMNS, DESCRIBE, SweepPoint, describe


def result_columns(sweep: list[SweepPoint]) -> list[str]:
    """The result columns the points have, in order: DESCRIBE, COLUMNS, and DEADLINE_COLUMNS with a deadline."""
    first = sweep[0].result if sweep else {}
    return DESCRIBE + COLUMNS + (DEADLINE_COLUMNS if "verdict" in first else []) if first else COLUMNS


def to_csv(sweep: list[SweepPoint]) -> str:
    keys = list(sweep[0].values) if sweep else []
    columns = [c for c in result_columns(sweep) if c not in keys]  # a field the grid varies is its column
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys + columns)
    for p in sweep:
        w.writerow([_cell(p.values[k]) for k in keys] + [p.result[c] for c in columns])
    return buf.getvalue()


def to_json(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list],
            deadline: dl.DeadlineBudget | None = None) -> str:
    columns = [c for c in result_columns(sweep) if c not in DESCRIBE]
    return json.dumps({"scenario": base.name, **describe(base),
                       "grid": {k: [_cell(v) for v in vs] for k, vs in grid.items()}, "unit": "B",
                       **({"deadline": deadline.as_json()} if deadline is not None else {}),
                       "points": [{"values": {k: _cell(v) for k, v in p.values.items()},
                                   **{c: p.result[c] for c in columns}} for p in sweep]},
                      indent=1, default=str) + "\n"


def _cell(value):
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def write(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list], csv_path: str | None,
          json_path: str | None, deadline: dl.DeadlineBudget | None = None) -> None:
    if csv_path:
        write_atomic(csv_path, to_csv(sweep).encode())
    if json_path:
        write_atomic(json_path, to_json(sweep, base, grid, deadline).encode())



__all__ = ["result_columns", "to_csv", "to_json", "write"]
