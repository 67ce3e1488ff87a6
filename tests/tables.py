"""Reading the CLI's printed tables back (tests of issue 37's "one unit per table"): a cell is a plain number in the
table's unit, or '<0.001' for a nonzero value too small for the table's decimals; never a number with a unit of its
own. The expected bytes come from the API or --json, converted here, not by the code under test."""

from __future__ import annotations

import re

UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
NUMBER = re.compile(r"^[+-]?[0-9][0-9,]*(\.[0-9]+)?$")
TINY = re.compile(r"^(<|>-)(0\.0*1|1)$")


def decimals(cell: str) -> int:
    return len(cell.split(".")[1]) if "." in cell else 0


def is_number(cell: str) -> bool:
    """A cell of a table in one unit: '2.844', '-214.7', '+0.754', '1,234', '<0.001', '>-0.001'."""
    return bool(NUMBER.match(cell) or TINY.match(cell))


def cell_equals(cell: str, exact: float, unit: str) -> bool:
    """The printed cell is `exact` bytes in `unit`, rounded to the cell's own decimals ('<0.001': nonzero and below
    half of 0.001)."""
    value = exact / UNIT_BYTES[unit]
    m = TINY.match(cell)
    if m:
        least = float(m.group(2))
        return 0 < abs(value) < least / 2 * (1 + 1e-9) and (value < 0) == (m.group(1) == ">-")
    assert NUMBER.match(cell), f"{cell!r} is not a number"
    return abs(float(cell.replace(",", "")) - value) <= 0.5 * 10 ** -decimals(cell) * (1 + 1e-9)
