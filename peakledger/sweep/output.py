"""A sweep's results as CSV and JSON (same grid, same bytes), written atomically.

The JSON carries every value as computed (bytes, seconds and hours unrounded) under the point's result keys. The CSV
is for people and spreadsheets: each column's unit in its name (`_bytes` whole bytes, `_s` seconds, `_h` hours),
floats rounded to CSV_DIGITS significant digits (analysis/units.py round_significant), and the two step times named
for what they are (CSV_NAMES):

- `mean_step_time_s` (JSON `step_time_s`): the simulated run's length over its steps, step 1's one-offs (the
  optimizer states' lazy creation, a load) included;
- `priced_step_time_s` (JSON `step_time_used_s`, with a deadline): the step time the deadline columns price, the
  cost model's steady step (after step 1) or the measured `--step-time`; `step_time_source` says which.
"""

from __future__ import annotations

import csv
import io
import json

from .. import deadline as dl
from ..analysis.units import round_significant
from ..scenario import Scenario
from ..simulator.safe_io import write_atomic
from .point import COLUMNS, DEADLINE_COLUMNS, DESCRIBE, SweepPoint, describe


def result_columns(sweep: list[SweepPoint]) -> list[str]:
    """The result columns the points have, in order: DESCRIBE, COLUMNS, and DEADLINE_COLUMNS with a deadline."""
    first = sweep[0].result if sweep else {}
    return DESCRIBE + COLUMNS + (DEADLINE_COLUMNS if "verdict" in first else []) if first else COLUMNS


CSV_NAMES = {"step_time_s": "mean_step_time_s", "step_time_used_s": "priced_step_time_s"}  # result key -> column
CSV_ROUNDED = ("step_time_s", "step_time_used_s", "wall_clock_h", "deadline_h", "late_by_h", "gpu_hours")
CSV_DIGITS = 4  # significant digits of the CSV's seconds and hours


def csv_name(column: str) -> str:
    """The CSV's name of a result column (CSV_NAMES; the others as they are)."""
    return CSV_NAMES.get(column, column)


def to_csv(sweep: list[SweepPoint]) -> str:
    keys = list(sweep[0].values) if sweep else []
    columns = [c for c in result_columns(sweep) if c not in keys]  # a field the grid varies is its column
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys + [csv_name(c) for c in columns])
    for p in sweep:
        w.writerow([_cell(p.values[k]) for k in keys] + [_rounded(c, p.result[c]) for c in columns])
    return buf.getvalue()


def _rounded(column: str, value):
    """A result cell for the CSV: the seconds and hours columns' floats to CSV_DIGITS significant digits."""
    if column in CSV_ROUNDED and isinstance(value, float):
        return round_significant(value, CSV_DIGITS)
    return value


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



__all__ = ["result_columns", "to_csv", "to_json", "write", "csv_name", "CSV_NAMES", "CSV_ROUNDED", "CSV_DIGITS"]
