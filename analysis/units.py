"""Byte counts and durations for people: parse budgets ("80GiB", "24G", "80GB", "85899345920"), print sizes and
times.

Inside, bytes are exact Python ints and times float seconds. Outside, every size says its unit: GiB (2^30) or
GB (10^9), with significant digits that do not fake precision (4 by default).

- a size in a sentence: `format_bytes` ('2.844 GiB', '9 MiB');
- a table of sizes: one `Scale` for the whole table, so its header names one unit and every cell is a number in
  it with the same decimals ('2.844', '0.232', '<0.001'), never a cell in another unit; the unit is the one
  asked for (--unit), else the binary unit of the table's largest value (`auto_unit`);
- a duration: `format_duration`, three significant digits in the unit people read it in ('0.400 ms',
  '850 ms', '51.0 s', '12.3 min', '1.42 h'), never scientific notation;
- a count of FLOPs in a sentence: `format_flops` ('91.88 GFLOP'); a training run's total, in the scaling papers'
  notation: `format_sci` ('6.00e16');
- a count of tokens or parameters: `format_count` ('50M', '1.2B', '15T': the K/M/B/T suffixes `peakledger plan`
  and `--target-tokens` read);
- a number for a file (CSV): `round_significant` (a float rounded to significant digits, not printed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..models.config import ConfigError

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# the short forms people type (docker's --memory 24g, `free -g`, PyTorch's max_split_size_mb docs): binary
SHORT_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# every spelling read, case-sensitive: a lowercase b is a bit (Mb, gb, Gib), so those are refused, never guessed;
# kB is the SI spelling of KB
READ_UNITS = {**UNITS, **SHORT_UNITS, "kB": 10**3}
PLAIN_BYTES_MIN = 1 << 20  # a number without a unit below 1 MiB is a forgotten unit ("--budget 80"), not bytes
_BUDGET = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def unit_scale(unit: str) -> int:
    """Bytes per `unit` (READ_UNITS, case-sensitive); a ValueError saying why for any other spelling."""
    if unit in READ_UNITS:
        return READ_UNITS[unit]
    like = [u for u in UNITS if u.lower() == unit.lower()]
    if not like:
        raise ValueError(f"unknown unit {unit!r}; allowed: {', '.join(UNITS)} (G = GiB)")
    meant = like[0]
    choices = f"{meant} ({_SPELLED[meant]})"
    if "i" not in meant and meant != "B":
        binary = meant[0] + "iB"
        choices += f" or {binary} ({_SPELLED[binary]})"
    if unit.endswith("b"):
        raise ValueError(f"unit {unit!r} is ambiguous (a lowercase b is a bit): write {choices}")
    raise ValueError(f"unit {unit!r} is spelled in another case than peakledger reads: write {choices}")


_SPELLED = {"B": "bytes", "KB": "10^3 B", "MB": "10^6 B", "GB": "10^9 B", "TB": "10^12 B", "KiB": "2^10 B",
            "MiB": "2^20 B", "GiB": "2^30 B", "TiB": "2^40 B"}


def parse_bytes(text: str | int, field: str = "budget", plain_bytes: bool = False) -> int:
    """'80GiB' and '80G' -> 85899345920, '80GB' -> 80000000000, '123B' -> 123. Fractions round down to whole
    bytes. A number without a unit is read as bytes only from PLAIN_BYTES_MIN up (a byte count copied from a
    tool); '80' is refused as a forgotten unit, so it never becomes an 80-byte budget. `plain_bytes`: a number
    without a unit is bytes at any size (a column of measured bytes, not a budget typed by hand)."""
    if isinstance(text, bool):
        raise ConfigError(field, f"expected a size like 80GiB, 80GB or plain bytes, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(field, f"must not be negative, got {text}")
        return text
    m = _BUDGET.match(str(text))
    if not m:
        raise ConfigError(field, f"cannot read {text!r}; use a number with a unit ({', '.join(UNITS)}; G = GiB), "
                                 "e.g. 80GiB, 24G, 80GB, or bytes with B")
    number, unit = m.group(1), m.group(2)
    try:
        scale = unit_scale(unit) if unit else 1
    except ValueError as e:
        raise ConfigError(field, f"cannot read {text!r}: {e}") from None
    if len(number) > 400:  # (no budget has 400 digits; int() refuses past 4,300 and is slow before)
        raise ConfigError(field, f"{len(number):,} digits is not a size any device has; use a unit, e.g. 80GiB")
    if not unit and not plain_bytes and int(number.partition(".")[0]) < PLAIN_BYTES_MIN:
        raise ConfigError(field, f"{text!r} has no unit: {number} bytes is not a memory size; give a unit, e.g. "
                                 f"{number}GiB, {number}G or {number}GB (or {number}B if you mean bytes)")
    whole, _, frac = number.partition(".")
    value = int(whole) * scale + (int(frac) * scale) // 10 ** len(frac) if frac else int(whole) * scale
    return value


SMALLER = {"TiB": "GiB", "GiB": "MiB", "MiB": "KiB", "KiB": "B", "TB": "GB", "GB": "MB", "MB": "KB", "KB": "B"}


def format_bytes(n: int, unit: str | None = "GiB", digits: int = 4) -> str:
    """'1.234 GiB'. `unit` is GiB or GB (or any unit in UNITS; None: GiB, the text's default); 'auto' picks a
    binary unit by size. For a size in a sentence: a table's cells take a `Scale`."""
    if unit is None:
        unit = "GiB"
    if unit == "auto":
        unit = next((u for u in ("TiB", "GiB", "MiB", "KiB") if abs(n) >= UNITS[u]), "B")
    if unit == "B":
        return f"{n:,} B"
    smaller = SMALLER.get(unit)
    if smaller and n and abs(n) < UNITS[unit] // 100:
        return format_bytes(n, smaller, digits)
    value = n / UNITS[unit]
    return f"{_significant(value, digits)} {unit}"


def _significant(value: float, digits: int) -> str:
    if value == 0:
        return "0"
    text = f"{value:.{digits}g}"
    if "e" in text:
        return f"{value:.{max(digits - 1, 0)}e}"
    return text


BINARY = ("TiB", "GiB", "MiB", "KiB")
MAX_DECIMALS = 6  # a table's cells show at most this many decimals (a forced unit far above its values: '<0.000001')
FLOP_UNITS = {"FLOP": 1, "kFLOP": 10**3, "MFLOP": 10**6, "GFLOP": 10**9, "TFLOP": 10**12, "PFLOP": 10**15}
TIME_UNITS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}  # a table's times: seconds in these
_SIZES = {**UNITS, **FLOP_UNITS, **TIME_UNITS}


def auto_unit(largest: int | float, kind: str = "bytes") -> str:
    """The unit a value of `largest` reads in: the largest unit it holds at least one of. Bytes: binary units, B
    under 1 KiB; "flops": FLOP_UNITS; "seconds": h, min, s, else ms (as `format_duration`)."""
    if kind == "seconds":
        return next((u for u in ("h", "min", "s") if abs(largest) >= TIME_UNITS[u]), "ms")
    if kind == "flops":
        return next((u for u in reversed(FLOP_UNITS) if abs(largest) >= FLOP_UNITS[u]), "FLOP")
    return next((u for u in BINARY if abs(largest) >= UNITS[u]), "B")


@dataclass(frozen=True)
class Scale:
    """One unit and one number of decimals for a whole table column (or table) of byte counts, FLOPs or seconds:
    the header says `unit`, each cell is `number(x)`. The decimals give the largest value `digits` significant
    digits; a value too small for them prints '<0.001' (nonzero, under half the last place), never in another
    unit."""

    unit: str
    decimals: int = 0

    @classmethod
    def of(cls, values: Iterable[int | float | None], unit: str | None = None, digits: int = 4,
           kind: str = "bytes") -> Scale:
        """The scale of a column holding `values` (None: no value, skipped) of `kind` (bytes, "flops", "seconds"):
        `unit` when given (the CLI's --unit; None or 'auto': `auto_unit` of the largest |value|)."""
        largest = max((abs(v) for v in values if v is not None), default=0)
        if unit in (None, "auto"):
            unit = auto_unit(largest, kind)
        if unit in ("B", "FLOP"):
            return cls(unit, 0)
        top = largest / _SIZES[unit]
        exp = math.floor(math.log10(top)) if top > 0 else 0
        return cls(unit, min(MAX_DECIMALS, max(0, digits - 1 - exp)))

    def number(self, x: int | float) -> str:
        """`x` (bytes, FLOPs, seconds) as a number in the unit: '2.844', '0.000', '<0.001', '-1.250', '1,234.5'."""
        if self.unit in ("B", "FLOP"):
            return f"{round(x):,}"
        text = f"{x / _SIZES[self.unit]:,.{self.decimals}f}"
        if x and not text.strip("-0.,"):  # nonzero, but zero at these decimals
            least = "1" if self.decimals == 0 else "0." + "0" * (self.decimals - 1) + "1"
            return f"<{least}" if x > 0 else f">-{least}"
        return text

    def text(self, x: int | float) -> str:
        """`x` with the unit: '2.844 GiB'."""
        return f"{self.number(x)} {self.unit}"

    def value(self, cell: str) -> float:
        """A printed `number` read back (bytes, FLOPs, seconds; '<0.001' reads as 0): its inverse, up to the
        decimals."""
        text = cell.replace(",", "").strip()
        if text.startswith(("<", ">")):
            return 0.0
        return float(text) * _SIZES[self.unit]


def fixed_significant(value: float, digits: int = 3) -> str:
    """`value` with `digits` significant digits in plain decimals, trailing zeros kept: 51.04 -> '51.0', 0.4 ->
    '0.400', 5104 -> '5,104' (digits past the decimal point are never cut from a whole number)."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    exp = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - exp)
    text = f"{value:,.{decimals}f}"
    if decimals and abs(float(text.replace(",", ""))) >= 10 ** (exp + 1):  # 9.996 -> '10.00': one decimal less
        text = f"{value:,.{decimals - 1}f}"
    return text


def format_duration(seconds: float, digits: int = 3) -> str:
    """A duration as people read it, `digits` significant digits: under a second in ms ('0.400 ms', '850 ms'),
    under a minute in s ('51.0 s'), under an hour in min ('12.3 min'), else h ('1.42 h', '1,234 h'); under a
    microsecond '<0.001 ms'. Never scientific notation. A negative duration (a difference) keeps its sign; inf and
    nan print as such."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds < 0:
        return "-" + format_duration(-seconds, digits)
    if seconds == 0:
        return "0 s"
    for unit in ("h", "min", "s", "ms"):
        text = fixed_significant(seconds / TIME_UNITS[unit], digits)
        if float(text.replace(",", "")) >= 1 or unit == "ms":
            return f"{text} {unit}" if seconds >= 1e-6 else "<0.001 ms"
    return f"{seconds} s"  # (not reached)


def round_significant(value: float, digits: int = 4) -> float:
    """`value` rounded to `digits` significant digits, for a file's column (5.0812345e-3 -> 0.005081)."""
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")  # (the nearest float to the decimal rounded: what the file then shows)


def format_flops(n: int | float) -> str:
    """'91.88 GFLOP', '382.3 TFLOP': four significant digits in the largest unit of FLOP_UNITS it holds one of."""
    if n == 0:
        return "0 FLOP"
    unit = auto_unit(n, "flops")
    return f"{n:,} FLOP" if unit == "FLOP" else f"{fixed_significant(n / FLOP_UNITS[unit], 4)} {unit}"


COUNT_UNITS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}  # tokens and parameters: 2B = 2e9


def format_sci(x: int | float, digits: int = 3) -> str:
    """`x` in scientific notation with `digits` significant digits and a bare exponent: 6e16 -> '6.00e16', 1.2e20
    -> '1.20e20', 950 -> '9.50e2' (the scaling papers' notation for FLOPs)."""
    if x == 0:
        return "0"
    mantissa, _, exponent = f"{x:.{digits - 1}e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def format_count(n: int | float) -> str:
    """A count of tokens or parameters, three significant digits with K, M, B or T: 50_000_000 -> '50M', 1.24e8 ->
    '124M', 7e9 -> '7B', 1.5e13 -> '15T'; under 1,000 as it is ('950'); 1,000T and up in `format_sci`."""
    if abs(n) < 1000:
        return f"{n:,}" if isinstance(n, int) else f"{n:.3g}"
    for unit, scale in COUNT_UNITS.items():  # the smallest unit the count reads under 1,000 in (rounded)
        if abs(n) / scale < 999.5:
            return f"{n / scale:.3g}{unit}"
    return format_sci(n)
