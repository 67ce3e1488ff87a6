"""The largest micro-batch that fits a budget, by exponential then binary search over exact ints.

`peak_of(b)` is the peak for micro-batch b (b = 0 means the fixed state alone: parameters, master
weights, gradients, optimizer states). The answer is the largest b with peak_of(b) <= budget,
0 when only the fixed state fits, and -1 when even the fixed state does not. The peak is assumed
non-decreasing in b. Python ints never overflow, so limits near 2^63 and beyond are fine.

`max_fitting` is the one search: `peakledger max-batch` runs it on simulated peaks (peakledger/api.py
`max_micro_batch`) and on the abstract memory model M(B) = fixed + per_sample x B (`batch_range`, `max-batch
--fixed X --per-sample Y --budget Z`), where it is checked against the closed form floor((Z - X) / Y).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..models.config import ConfigError
from .units import parse_bytes


def max_fitting(peak_of: Callable[[int], int], budget: int, limit: int = 2**64, start: int = 1) -> int:
    """The search (module docstring). `start`: a micro-batch to probe first (the scenario's own, whose peak the caller
    already has): where it fits, the doubling starts from it and the sizes below it are not probed (the peak being
    non-decreasing, they fit); where it does not, the search stays below it. The answer is the same for any `start`."""
    start = min(max(start, 1), limit)
    if start > 1 and peak_of(start) <= budget:
        lo, hi = start, start * 2  # peak_of(lo) fits, and so do 0 .. lo - 1
    else:
        if peak_of(0) > budget:
            return -1
        if peak_of(1) > budget:
            return 0
        lo, hi = 1, 2  # peak_of(lo) fits; find hi that does not (or reaches limit)
        if start > 1:
            hi = start  # known not to fit: the binary search below takes it from here
    while hi <= limit and hi != start and peak_of(hi) <= budget:
        lo, hi = hi, hi * 2
    if hi > limit:
        if peak_of(limit) <= budget:
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_of(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


ABSTRACT_LIMIT = 2**256  # fixed, per-sample and budget above this are refused (far past any memory; the search
# stays a few hundred exact-int steps)
ABSTRACT_FLAGS = {"fixed": "--fixed", "per_sample": "--per-sample", "budget": "--budget"}


@dataclass(frozen=True)
class BatchRange:
    """The micro-batches B that fit the abstract memory model M(B) = fixed + per_sample x B under `budget` (a B fits
    when M(B) <= budget: equality fits). `max_batch` is the largest that fits, by `max_fitting`: 0 when the fixed
    part fits and not one sample more, -1 when not even the fixed part does; the feasible range is 1..max_batch.
    Every value is an exact int (no overflow at any size up to ABSTRACT_LIMIT)."""

    fixed: int
    per_sample: int
    budget: int
    max_batch: int

    @property
    def feasible(self) -> bool:
        return self.max_batch >= 1

    @property
    def feasible_range(self) -> tuple[int, int] | None:
        return (1, self.max_batch) if self.feasible else None

    def memory(self, b: int) -> int:
        """M(b) = fixed + per_sample x b."""
        return self.fixed + self.per_sample * b

    @property
    def closed_form(self) -> int:
        """floor((budget - fixed) / per_sample), -1 when the fixed part is over the budget."""
        return max((self.budget - self.fixed) // self.per_sample, -1)

    def as_json(self) -> dict:
        top = self.max_batch
        return {"fixed": self.fixed, "per_sample": self.per_sample, "budget": self.budget, "max_micro_batch": top,
                "feasible": self.feasible, "feasible_range": list(self.feasible_range) if self.feasible else None,
                "memory_at_max": self.memory(top) if top >= 0 else None,
                "spare_at_max": self.budget - self.memory(top) if top >= 0 else None,
                "memory_one_more": self.memory(top + 1), "closed_form": self.closed_form}


def _checked(name: str, value: object, least: int) -> int:
    flag = ABSTRACT_FLAGS[name]
    allowed = f"a whole number >= {least}" + (" (0: no fixed part)" if least == 0 else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"{flag} must be {allowed}, got {value!r}")
    if value < least:
        raise ConfigError(name, f"{flag} must be {allowed}, got {value}")
    if value > ABSTRACT_LIMIT:
        raise ConfigError(name, f"{flag} {value} is over 2^256, the largest value the solver takes; allowed: "
                                f"{allowed} up to 2^256")
    return value


def batch_range(fixed: int, per_sample: int, budget: int) -> BatchRange:
    """The micro-batches that fit M(B) = fixed + per_sample x B <= budget, searched by `max_fitting` (the search
    real models use) with the limit `budget` (per_sample >= 1, so no B above it fits). `fixed` >= 0, `per_sample`
    and `budget` >= 1, ints up to ABSTRACT_LIMIT: anything else is a ConfigError naming the flag."""
    fixed = _checked("fixed", fixed, 0)
    per_sample = _checked("per_sample", per_sample, 1)
    budget = _checked("budget", budget, 1)
    found = max_fitting(lambda b: fixed + per_sample * b, budget, limit=budget)
    result = BatchRange(fixed, per_sample, budget, found)
    if found != result.closed_form:  # (a bug, never an answer: the CLI reports it as an internal error)
        raise RuntimeError(f"max_fitting found {found}, the closed form {result.closed_form}")
    return result


FORMS = "a whole number (100, 9223372036854775807) or a size with a unit (80GiB, 24G, 80GB, 512B)"
_WHOLE = re.compile(r"^\s*-?[0-9]+\s*$")
_MAX_DIGITS = 400  # (2^256 has 78 digits; int() of thousands of digits is refused by Python, and slow before)


def read_amount(value: object, name: str) -> tuple[int, bool]:
    """(the exact int, whether it was written with a byte unit) of one of --fixed / --per-sample / --budget: an
    int, a whole number ("100", "-3": the sign is judged by `batch_range`), or a size parse_bytes reads ("80GiB")."""
    flag = ABSTRACT_FLAGS[name]
    if isinstance(value, int) and not isinstance(value, bool):
        return value, False
    if not isinstance(value, str):
        raise ConfigError(name, f"{flag} takes {FORMS}, got {value!r}")
    if _WHOLE.match(value):
        if len(value.strip()) > _MAX_DIGITS:
            raise ConfigError(name, f"{flag} has {len(value.strip()):,} digits, past 2^256, the largest value the "
                                    f"solver takes; allowed: {FORMS}")
        return int(value), False
    try:
        return parse_bytes(value, name), True
    except ConfigError as e:
        said = f"cannot read {value!r}" if e.message.startswith(f"cannot read {value!r};") else e.message
        raise ConfigError(name, f"{flag} {said}; allowed: {FORMS}") from None


def solve(fixed: object, per_sample: object, budget: object) -> tuple[BatchRange, bool]:
    """(the range, whether the values are bytes): each value read by `read_amount`, all with units or none."""
    read = {name: read_amount(value, name) for name, value in (("fixed", fixed), ("per_sample", per_sample),
                                                               ("budget", budget))}
    sized = [n for n, (_, unit) in read.items() if unit]
    plain = [n for n, (_, unit) in read.items() if not unit]
    if sized and plain:
        raw = {"fixed": fixed, "per_sample": per_sample, "budget": budget}
        raise ConfigError(plain[0], f"{ABSTRACT_FLAGS[plain[0]]} {raw[plain[0]]!r} has no unit while "
                                    f"{ABSTRACT_FLAGS[sized[0]]} {raw[sized[0]]!r} has one: give every value a unit "
                                    "(e.g. 20GiB, or 100B for bytes) or none (numbers in a unit of your own)")
    values = {n: v for n, (v, _) in read.items()}
    return batch_range(values["fixed"], values["per_sample"], values["budget"]), bool(sized)
