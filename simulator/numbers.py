"""Numbers in text, read one way everywhere (flags, `--case` / `--grid` values, CSV cells, ledger events): ASCII
digits only. Python's int() and float() take any Unicode digit ('๓' is 3, '²' raises later) and underscores
('1_000'), so a cell that looks like nothing a user typed would be read as a number; here it is not a number.

`int_text` and `float_text` give the number, or None when the text is not one in these forms:
- an integer: an optional sign, then ASCII digits;
- a float: an optional sign, digits with an optional fraction, an optional exponent (`1.5`, `.5`, `2e9`,
  `1E-3`), or Python's words `inf`, `infinity`, `nan` (any case; the field that takes the value refuses them
  by name where it must be finite).
Surrounding spaces are allowed, as int() allows them.
"""

from __future__ import annotations

import re

_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
                    re.ASCII | re.IGNORECASE)


def int_text(text: str) -> int | None:
    """The integer `text` spells in ASCII digits, else None (a ValueError of int() past Python's digit limit is
    left to the caller, which says it)."""
    s = text.strip(" \t")
    return int(s) if _INT.fullmatch(s) else None


def float_text(text: str) -> float | None:
    """The float `text` spells (see the module docstring), else None."""
    s = text.strip(" \t")
    return float(s) if _FLOAT.fullmatch(s) else None


def non_ascii_digit(text: str) -> str | None:
    """The first character of `text` that Python takes as a digit but is not 0-9 ('๓', '²'), for a message."""
    return next((c for c in text if c.isdigit() and not ("0" <= c <= "9")), None)


__all__ = ["int_text", "float_text", "non_ascii_digit"]
