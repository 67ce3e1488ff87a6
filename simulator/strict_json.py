"""One rule for every JSON file peakledger reads (HF configs, traces, calibrations, ledger events, MoE routing
counts): `loads` is `json.loads` that refuses what a data file never means.

- a key given twice in one object (json.loads keeps the last one silently);
- a number that is not finite once read (`1e999` is read as inf) or an integer of more digits than Python reads
  (`sys.get_int_max_str_digits()`);
- `NaN`, `Infinity` and `-Infinity`, which are not JSON (json.loads takes them) unless the reader asks for them
  (`constants=True`: it refuses them itself, where they stand, naming the field);
- nesting deeper than `MAX_DEPTH` (no peakledger format nests past a dozen levels; Python's own recursion limit
  ends deeper ones with a RecursionError, turned into the same refusal).

Every refusal is a `JSONRefused` (a ValueError) whose message says what and where (the key, the number); the
reader turns it into its own InputError naming its file. Only ASCII digits are numbers: json's C scanner reads
`[0-9]` only (Modules/_json.c, CPython 3.11), unlike int() and float(), which take any Unicode digit.
"""

from __future__ import annotations

import json
import math
import sys

from .safe_io import too_many_digits

MAX_DEPTH = 64


class JSONRefused(ValueError):
    """A JSON text that parses but is not data peakledger reads (see the module docstring)."""


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise JSONRefused(f"the key {key[:80]!r} is given twice in one object (which one is meant?)")
        out[key] = value
    return out


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRefused(f"the number {text[:40]} is out of range (no finite float holds it)")
    return value


def _constant(name: str) -> float:
    raise JSONRefused(f"{name} is not a JSON number; give a finite number")


def depth(value: object) -> int:
    """How deeply `value`'s lists and objects nest (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((x, level + 1) for x in item if isinstance(x, (list, dict)))
    return deepest


def loads(text: str, constants: bool = False) -> object:
    """`text` parsed by the rule of the module docstring; JSONRefused, or json.JSONDecodeError (a ValueError)
    for text that is not JSON."""
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_float=_float,
                           parse_constant=float if constants else _constant)
    except ValueError as e:  # (json's own int() past Python's digit limit: a plain ValueError, not a decode error)
        if not too_many_digits(e):
            raise
        raise JSONRefused(f"it holds an integer of more than {sys.get_int_max_str_digits():,} digits (Python's limit "
                          "for reading one); no count or size is that long") from None
    except RecursionError:
        raise JSONRefused(f"it is nested too deeply (deeper than Python reads; peakledger's files nest {MAX_DEPTH} "
                          "levels at most)") from None
    if depth(value) > MAX_DEPTH:
        raise JSONRefused(f"it is nested too deeply ({depth(value)} levels; peakledger's files nest {MAX_DEPTH} at "
                          "most)")
    return value


__all__ = ["JSONRefused", "MAX_DEPTH", "depth", "loads"]
