"""The largest micro-batch that fits a budget, by exponential then binary search over exact ints.

`peak_of(b)` is the peak for micro-batch b (b = 0 means the fixed state alone: parameters, master
weights, gradients, optimizer states). The answer is the largest b with peak_of(b) <= budget,
0 when only the fixed state fits, and -1 when even the fixed state does not. The peak is assumed
non-decreasing in b. Python ints never overflow, so limits near 2^63 and beyond are fine.

`max_fitting` is the one search: `peakledger max-batch` runs it on simulated peaks (peakledger/api.py
`max_micro_batch`, guided: the sizes probed after two points are where the line through them meets the budget, as
activations grow about linearly; each probe is a simulation, and a trace for a new size of a traced model) and on
the abstract memory model M(B) = fixed + per_sample x B (`batch_range`, `max-batch
--fixed X --per-sample Y --budget Z`), where it is checked against the closed form floor((Z - X) / Y).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..models.config import ConfigError
from .units import parse_bytes

GUIDED = 3  # probes `max_fitting` places by `guess`, at most (then it only doubles and halves)


def max_fitting(peak_of: Callable[[int], int], budget: int, limit: int = 2**64, start: int = 1,
                guided: bool = False) -> int:
    """The search (module docstring). `start`: a micro-batch to probe first (the scenario's own, whose peak the caller
    already has): where it fits, the doubling starts from it and the sizes below it are not probed (the peak being
    non-decreasing, they fit); where it does not, the search stays below it. `guided`: the next size probed is the
    one `guess` puts the budget's crossing at, and the one above it, while inside the bracket (at most GUIDED such
    probes): for peaks near linear in b (activations) two probes after two points instead of a doubling and a
    halving to the end, each probe being a simulation (a trace for a new size). The answer is the same for any
    `start` and either way (the largest b that fits, the peak being non-decreasing)."""
    start = min(max(start, 1), limit)
    seen: dict[int, int] = {}

    def peak(b: int) -> int:
        if b not in seen:
            seen[b] = peak_of(b)
        return seen[b]

    hi: int | None = None  # peak(hi) does not fit (None: none found yet); peak(lo) fits, and so do 0 .. lo - 1
    if start > 1 and peak(start) <= budget:
        lo = start
    else:
        if peak(0) > budget:
            return -1
        if peak(1) > budget:
            return 0
        lo, hi = 1, (start if start > 1 else None)
    placed = 0
    while hi is None or hi - lo > 1:
        top = limit + 1 if hi is None else hi
        g = guess(seen, budget, lo, hi) if guided and placed < GUIDED else None
        probe = next((c for c in ((g, g + 1) if g is not None else ()) if lo < c < top and c not in seen), None)
        if probe is not None:
            placed += 1
        elif hi is None:
            if lo == limit:
                return limit
            probe = min(lo * 2, limit)
        else:
            probe = (lo + hi) // 2
        if peak(probe) <= budget:
            lo = probe
        else:
            hi = probe
    return lo


def guess(seen: dict[int, int], budget: int, lo: int, hi: int | None) -> int | None:
    """The largest b at which the line through two probed points stays within `budget`: through lo (fits) and hi
    (does not) where hi is known, else through lo and the largest probed size below it; None where there is no
    second point or the line does not rise."""
    below = [b for b in seen if b < lo and b > 0]
    other = hi if hi is not None else (max(below) if below else None)
    if other is None or lo not in seen or seen[other] == seen[lo]:
        return None
    slope_num, slope_den = seen[other] - seen[lo], other - lo
    if slope_num * slope_den <= 0:  # (a peak that falls with b: no crossing to aim at)
        return None
    return lo + (budget - seen[lo]) * slope_den // slope_num


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
