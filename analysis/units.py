"""Byte counts for people: parse budgets ("80GiB", "24G", "80GB", "85899345920") and print sizes.

Inside, bytes are exact Python ints. Outside, every size says its unit: GiB (2^30) or GB (10^9),
with significant digits that do not fake precision (4 by default).
"""

from __future__ import annotations

import re

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


def format_bytes(n: int, unit: str = "GiB", digits: int = 4) -> str:
    """'1.234 GiB'. `unit` is GiB or GB (or any unit in UNITS); 'auto' picks a binary unit by size."""
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
