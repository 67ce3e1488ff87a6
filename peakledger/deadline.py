"""A memory budget and a deadline together: which setups of a sweep fit the memory budget and reach a target of
tokens (or of optimizer steps) before a wall-clock deadline, and what each costs in GPU-hours.

    peakledger sweep --preset llama-3-8b --seq-len 4096 --world-size 8 --zero-stage 3 --device H100-80GB \\
        --grid micro_batch=1,2,4,8 --grid checkpointing=none,full --target-tokens 2e10 --deadline 3.5d \\
        --output s.csv

(Llama-3 8B on eight H100-80GB, ZeRO-3, sequences of 4096: without checkpointing, micro-batches 4 and 8 would
be the fastest and do not fit; micro-batches 2 and 1 fit and meet the deadline, 2 the cheaper; with full
checkpointing every micro-batch fits and is 19 to 28 h late; tests/test_deadline.py checks it by hand.)

Per point (`plan_point`, plain arithmetic on what the simulation gave):

- the setup priced: the point's, or with `--max-batch` the one the sweep recommends, the point at its largest
  micro-batch that fits the budget (`priced_micro_batch` says which; its own simulation gives the step time and the
  memory); where no micro-batch fits, micro-batch 1, priced as not fitting (OOM by its excess), never the grid's;
- tokens per step = micro_batch x seq_len x grad_accum x dp (dp = world_size / (tp x pp x cp));
- steps needed = ceil(target tokens / tokens per step), or `--target-steps` as given;
- step time: the cost model's steady step (`steady_step_seconds`: the simulated run after step 1, whose one-offs
  such as the optimizer states' lazy creation are not repeated, over the steps after it; step 1 itself when only
  one step is simulated), or a measured one (`--step-time 1.9s`, the same for every point: a measurement of
  one setup, priced for all);
- wall-clock = steps x step time; it meets the deadline when wall-clock <= deadline;
- GPU-hours = steps x world_size x step time / 3600 (every rank is a GPU priced for the whole run; the integer
  product first, so setups of equal cost tie exactly);
- memory: the capacity the point needs against the budget (`--budget`, else each point's device profile's
  capacity), by the sweep's own `fits` (on a GPU profile, the caching allocator's rule). The budget is a real
  capacity or refused: the cpu profile's size is a placeholder, so a point on cpu needs `--budget` (`check_sweep`
  refuses it before any work when the grid does not vary the device; `point_budget` makes it the point's error row
  when it does).

What is priced is training: a setup with `passes` "forward" (forward passes only, no backward, no optimizer step)
is refused by name (`check_sweep` before any work, else the point's error row). Its step is not a training step,
so a token target, an optimizer-step target and GPU-hours would price a run nobody does, and its forward keeps
autograd's saved tensors, so it is not an inference run either (which runs under torch.no_grad) to price instead.

No price is inf or nan: the inputs are bounded (durations from 1 ms to 100 years, exactly parsed; targets at most
1e21), and every computed column is checked finite, else the point is refused by the column's name.

`rank_points` orders the points: those meeting both first, by GPU-hours (then wall-clock, then grid order);
then those that fit but are late, least late first; then those over the memory budget, smallest excess first;
then invalid points. Every point has a verdict: "meets both", "late by Y h", "OOM by X GiB" (with
"; late by Y h" when both fail), "invalid (see error)".

Inputs are parsed here (`parse_duration`, `parse_count`, `deadline_budget`): bad ones are a ConfigError naming
the flag and the allowed forms (the CLI's one line, exit 2). A duration is read exactly (a decimal number times
its unit, as a fraction) and must lie from MIN_DURATION_S (1 ms) to MAX_DURATION_S (100 years of 365.25 days,
36525d); it is then rounded once to the nearest float.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from .analysis.report import run_plan, run_seconds, step_ends
from .analysis.units import Scale, format_bytes, format_duration
from .models.config import ConfigError
from .models.devices import device_profile
from .scenario import Scenario
from .simulator.events import EventLog

DURATION_UNITS = {"ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60), "h": Fraction(3600),
                  "d": Fraction(86400)}
MIN_DURATION_S = Fraction(1, 1000)  # 1 ms: no deadline or measured training step is shorter
MAX_DURATION_S = Fraction(36525 * 86400)  # 100 years of 365.25 days: no deadline or step is longer
DURATION_FORMS = "a number > 0 with a unit ms, s, m, h or d (e.g. 1.9s, 90m, 48h, 2d), from 1ms to 100 years (36525d)"
COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
COUNT_FORMS = "a whole number > 0: 2000000000, 2e9, 2.5e9, or with K, M, B, T (2B = 2e9)"
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)((?:[eE][+-]?[0-9]+)?)"
_DURATION = re.compile(rf"^\s*([+-]?){_NUMBER}\s*([A-Za-z]*)\s*$")
_COUNT = re.compile(rf"^\s*([+-]?){_NUMBER}\s*([A-Za-z]?)\s*$")
_MAX_TEXT = 64  # characters: no duration or count anyone means is longer
_MAX_COUNT = 10**21  # tokens or steps: far past any training run (and exact in a Python int)

SOURCE_MODEL = "cost model (steady step)"
SOURCE_MODEL_ONE_STEP = "cost model (step 1: only one step simulated)"
SOURCE_MEASURED = "measured (--step-time, every point)"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def parse_duration(text: object, field: str = "deadline") -> float:
    """'48h' -> 172800.0 seconds ('1.9s', '90m', '2d', '350ms'). A number without a unit is refused: 48 could be
    seconds or hours. Read exactly (digits x 10^exponent x the unit, a fraction: no underflow to 0, no overflow
    to inf), then refused outside MIN_DURATION_S .. MAX_DURATION_S (1 ms .. 100 years) with which bound it
    passes; zero and negative values are refused as such, and so are inf and nan (not numbers it reads)."""
    flag = _flag(field)
    if isinstance(text, bool) or not isinstance(text, str):
        raise ConfigError(field, f"{flag} takes {DURATION_FORMS}, got {text!r}")
    m = _DURATION.match(text) if len(text) <= _MAX_TEXT else None
    if not m:
        raise ConfigError(field, f"{flag} cannot read {text!r}; allowed: {DURATION_FORMS}")
    sign, number, exponent, unit = m.groups()
    if not unit:
        raise ConfigError(field, f"{flag} {text.strip()!r} has no unit; allowed: {DURATION_FORMS}")
    if unit not in DURATION_UNITS:
        raise ConfigError(field, f"{flag} {text.strip()!r}: unknown unit {unit!r}; allowed: {DURATION_FORMS}")
    whole, _, frac = number.partition(".")
    digits = int((whole or "0") + frac)
    if digits == 0 or sign == "-":
        raise ConfigError(field, f"{flag} must be > 0, got {text.strip()!r}; allowed: {DURATION_FORMS}")
    power = (int(exponent[1:]) if exponent else 0) - len(frac)  # value = digits x 10^power (digits < 10^64)
    # outside -80 .. 20 the value is out of range whatever the digits and unit: decided without building 10^power
    if power < -80:
        seconds = Fraction(0)
    elif power > 20:
        seconds = MAX_DURATION_S + 1
    else:
        seconds = digits * Fraction(10) ** power * DURATION_UNITS[unit]
    if seconds < MIN_DURATION_S:
        raise ConfigError(field, f"{flag} {text.strip()!r} is too small: under 1ms, the shortest duration it takes; "
                                 f"allowed: {DURATION_FORMS}")
    if seconds > MAX_DURATION_S:
        raise ConfigError(field, f"{flag} {text.strip()!r} is too large: over 100 years (36525d), the longest "
                                 f"duration it takes; allowed: {DURATION_FORMS}")
    return float(seconds)  # the exact value rounded once


def parse_count(text: object, field: str = "target_tokens", limit: int = _MAX_COUNT) -> int:
    """'2e9' -> 2000000000 ('2000000000', '2.5e9', '2B', '500M'): exact, a whole number > 0, at most `limit`
    (default 1e21)."""
    return int(parse_amount(text, field, limit=limit))


def parse_amount(text: object, field: str, *, limit: int = _MAX_COUNT, whole: bool = True,
                 forms: str = COUNT_FORMS) -> Fraction:
    """The exact value of '2e9', '2.5B', '35k', '1234.5' (digits x 10^exponent x the K/M/B/T suffix), > 0 and at
    most `limit` (a power of ten); `whole`: a whole number or refused. A ConfigError naming the flag and `forms`."""
    flag = _flag(field)
    top = f"1e{len(str(limit)) - 1}" if limit == 10 ** (len(str(limit)) - 1) else f"{limit:,}"
    if isinstance(text, int) and not isinstance(text, bool):
        value = Fraction(text)
    else:
        m = _COUNT.match(text) if isinstance(text, str) and len(text) <= _MAX_TEXT else None
        if not m or m.group(4).lower() not in COUNT_SUFFIXES:
            raise ConfigError(field, f"{flag} cannot read {text!r}; allowed: {forms}")
        sign, number, exponent, suffix = m.groups()
        whole_part, _, frac = number.partition(".")
        exp = int(exponent[1:]) if exponent else 0
        if abs(exp) > len(str(limit)) + 9:
            raise ConfigError(field, f"{flag} {text.strip()!r} is out of range (at most {top}); allowed: {forms}")
        # exact: digits x 10^(exp - len(frac)) x suffix
        value = Fraction(int((whole_part or "0") + frac) * COUNT_SUFFIXES[suffix.lower()]) * Fraction(10) ** \
            (exp - len(frac))
        if whole and value.denominator != 1:
            raise ConfigError(field, f"{flag} {text.strip()!r} is not a whole number; allowed: {forms}")
        value = -value if sign == "-" else value
    if value <= 0:
        raise ConfigError(field, f"{flag} must be > 0, got {text!r}; allowed: {forms}")
    if value > limit:
        raise ConfigError(field, f"{flag} {text!r} is out of range (at most {top}); allowed: {forms}")
    return value


@dataclass(frozen=True)
class DeadlineBudget:
    """What a run must reach and by when: a target (tokens or optimizer steps, exactly one), a wall-clock
    deadline, optionally a measured step time (else the cost model's) and a memory budget per rank (else each
    point's device capacity)."""

    deadline_s: float
    target_tokens: int | None = None
    target_steps: int | None = None
    step_time_s: float | None = None  # measured seconds per optimizer step; None: the cost model's
    memory_bytes: int | None = None  # per rank; None: the point's device profile's capacity

    def __post_init__(self) -> None:
        if (self.target_tokens is None) == (self.target_steps is None):
            raise ConfigError("target_tokens", "give exactly one target: --target-tokens N (e.g. 2e9) or "
                                               "--target-steps N (e.g. 10000)")
        for name in ("target_tokens", "target_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0
                                      or value > _MAX_COUNT):
                raise ConfigError(name, f"{_flag(name)} must be a whole number > 0 and at most 1e21, got {value!r}; "
                                        f"allowed: {COUNT_FORMS}")
        for name in ("deadline_s", "step_time_s"):
            value = getattr(self, name)
            if value is None and name == "step_time_s":
                continue
            field = name[:-2]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                       and value > 0):
                raise ConfigError(field, f"{_flag(field)} must be seconds > 0, got {value!r}; "
                                         f"allowed: {DURATION_FORMS}")
            if not float(MIN_DURATION_S) <= value <= float(MAX_DURATION_S):
                raise ConfigError(field, f"{_flag(field)} must be seconds from 0.001 (1 ms) to {MAX_DURATION_S} "
                                         f"(100 years), got {value!r}; allowed: {DURATION_FORMS}")
        if self.memory_bytes is not None and (isinstance(self.memory_bytes, bool)
                                              or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0):
            raise ConfigError("budget", f"must be bytes > 0, got {self.memory_bytes!r}")

    def as_json(self) -> dict:
        return {"target_tokens": self.target_tokens, "target_steps": self.target_steps,
                "deadline_s": self.deadline_s, "deadline_h": self.deadline_s / 3600,
                "step_time_s": self.step_time_s, "memory_budget_bytes": self.memory_bytes}

    def describe(self, unit: str | None = "GiB") -> str:
        target = (f"{self.target_tokens:,} tokens" if self.target_tokens is not None
                  else f"{self.target_steps:,} optimizer steps")
        step = f"measured step time {format_duration(self.step_time_s)}" if self.step_time_s is not None else \
            "the cost model's steady step time"
        memory = f"{format_bytes(self.memory_bytes, unit)} per rank (--budget)" if self.memory_bytes is not None \
            else "each point's device capacity"
        return f"target {target} within {format_duration(self.deadline_s)}; {step}; memory: {memory}"


def deadline_budget(target_tokens=None, target_steps=None, deadline=None, step_time=None,
                    memory_bytes: int | None = None) -> DeadlineBudget | None:
    """The budget from the CLI's strings (None when none of the deadline flags is given); a flag without the
    ones it needs is refused by name."""
    if target_tokens is None and target_steps is None and deadline is None and step_time is None:
        return None
    if target_tokens is not None and target_steps is not None:
        raise ConfigError("target_tokens", "give one target, not both: --target-tokens N (tokens, e.g. 2e9) or "
                                           "--target-steps N (optimizer steps, e.g. 10000)")
    if deadline is None:
        given = "--step-time" if target_tokens is None and target_steps is None else \
            ("--target-tokens" if target_tokens is not None else "--target-steps")
        raise ConfigError("deadline", f"{given} needs --deadline, the wall-clock limit: {DURATION_FORMS}")
    seconds = parse_duration(deadline, "deadline")
    if target_tokens is None and target_steps is None:
        raise ConfigError("target_tokens", "--deadline needs a target: --target-tokens N (e.g. 2e9) or "
                                           "--target-steps N (e.g. 10000)")
    return DeadlineBudget(
        deadline_s=seconds,
        target_tokens=parse_count(target_tokens, "target_tokens") if target_tokens is not None else None,
        target_steps=parse_count(target_steps, "target_steps") if target_steps is not None else None,
        step_time_s=parse_duration(step_time, "step_time") if step_time is not None else None,
        memory_bytes=memory_bytes)


# --- what a deadline sweep may price

def _no_capacity(device: str, memory_bytes: int, point: bool) -> ConfigError:
    where = "this point's device, cpu," if point else f"--device {device}"
    return ConfigError("budget", f"a deadline sweep checks memory against a real capacity, and {where} has no memory "
                                 f"size of its own (the cpu profile's {format_bytes(memory_bytes, 'GiB')} is a "
                                 "placeholder): give --budget (the memory per rank, e.g. --budget 24GiB) or a GPU "
                                 "--device (e.g. H100-80GB), whose memory is the budget")


def _not_training(point: bool) -> ConfigError:
    where = "this point runs" if point else "--passes forward runs"
    return ConfigError("passes", f"a deadline prices training steps (forward, loss, backward, optimizer step; "
                                 f"--target-steps counts optimizer steps), and {where} forward passes only, with no "
                                 "backward or optimizer step (nor an inference run: autograd keeps its saved "
                                 "tensors): drop --passes forward, or the deadline flags")


def check_sweep(base: Scenario, grid: dict[str, list], budget: int | None, deadline: DeadlineBudget | None,
                max_batch: bool = False) -> None:
    """Refuse, before any work, a deadline sweep whose every point would be priced on nothing: the base device is
    the cpu profile (no real memory size) with no `budget` (nor the deadline's `memory_bytes`) and the grid does
    not vary `device`; the base setup runs `passes` "forward" and the grid does not vary `passes`. A grid that
    varies either is checked per point (`point_budget`: that point's error row). Without a deadline nothing is
    checked here; `max_batch` searches against the same budget, so it needs the same real capacity."""
    if deadline is None:
        return
    if budget is None:
        budget = deadline.memory_bytes
    if budget is None and "device" not in grid:
        profile = device_profile(base.device)
        if profile.is_cpu:
            raise _no_capacity(base.device, profile.memory_bytes, point=False)
    if base.setup.batch.passes == "forward" and "passes" not in grid:
        raise _not_training(point=False)


def point_budget(scenario: Scenario, budget: int | None) -> int:
    """The memory budget one point of a deadline sweep is checked (and, with max-batch, searched) against:
    `budget`, else the point's device profile's capacity when it is a GPU's; a ConfigError naming `budget` for a
    point on the cpu profile without one, and naming `passes` for a point that runs forward passes only (what the
    deadline prices is training)."""
    if scenario.setup.batch.passes == "forward":
        raise _not_training(point=True)
    if budget is not None:
        return budget
    profile = device_profile(scenario.device)
    if profile.is_cpu:
        raise _no_capacity(scenario.device, profile.memory_bytes, point=True)
    return profile.memory_bytes


# --- the arithmetic

def tokens_per_step(micro_batch: int, seq_len: int, grad_accum: int, dp: int) -> int:
    """Tokens one optimizer step consumes: micro_batch x seq_len x grad_accum x data-parallel ranks."""
    return micro_batch * seq_len * grad_accum * dp


def steps_needed(budget: DeadlineBudget, tokens: int) -> int:
    """Optimizer steps to reach the target: ceil(target tokens / tokens per step), or the target steps."""
    if budget.target_steps is not None:
        return budget.target_steps
    return -(-budget.target_tokens // tokens)  # exact integer ceiling


def steady_step_seconds(log: EventLog) -> tuple[float, str]:
    """The cost model's seconds per optimizer step once step 1's one-offs have passed, on the slowest rank:
    (the run's end - step 1's end) / (steps - 1), the later steps' repeats included; with one step, that
    step (from the start, the load included). With the label of which it is."""
    plan = run_plan(log)
    if plan.steps < 2:
        return run_seconds(log), SOURCE_MODEL_ONE_STEP
    return max(((plan.end_time(r) - r.get(1, 0.0)) / (plan.steps - 1) for r in step_ends(log).values()),
               default=0.0), SOURCE_MODEL


def plan_point(budget: DeadlineBudget, *, tokens: int, step_time_s: float, step_time_source: str,
               world_size: int, capacity_needed: int, fits: bool, memory_bytes: int,
               micro_batch: int | None = None) -> dict:
    """The deadline columns of one point (see the module docstring); `step_time_s` is the cost model's, replaced
    by the budget's measured one when it has one; `micro_batch`: the micro-batch priced (`priced_micro_batch`,
    empty when not given). A price that is not a finite number (a step time that is not > 0, or a product past
    a float's range) is a ConfigError naming the column, never an inf or nan in a row."""
    if budget.step_time_s is not None:
        step_time_s, step_time_source = budget.step_time_s, SOURCE_MEASURED
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ConfigError("tokens_per_step", f"must be a whole number > 0, got {tokens!r}")
    if isinstance(step_time_s, bool) or not isinstance(step_time_s, (int, float)) or \
            not (math.isfinite(step_time_s) and step_time_s > 0):
        raise ConfigError("step_time", f"the {step_time_source} is {step_time_s!r} s per step: not a time to price "
                                       f"a run with; give --step-time, a measured step ({DURATION_FORMS})")
    steps = steps_needed(budget, tokens)
    try:
        wall_s = steps * step_time_s  # GPU-hours below: (steps x world_size) x step time, so equal products are equal
        gpu_hours = steps * world_size * step_time_s / 3600
    except OverflowError:  # an integer product past a float's range
        wall_s = gpu_hours = math.inf
    wall_h = wall_s / 3600
    on_time = wall_s <= budget.deadline_s
    over = 0 if fits else max(0, capacity_needed - memory_bytes)
    late_h = 0.0 if on_time else (wall_s - budget.deadline_s) / 3600
    for column, value in (("wall_clock_h", wall_h), ("late_by_h", late_h), ("gpu_hours", gpu_hours)):
        if not math.isfinite(value):
            raise ConfigError(column, f"is {value} ({steps:,} steps x {step_time_s:g} s x {world_size} GPUs is past "
                                      "a float's range): not a price; give a smaller target or step time")
    return {"target_tokens": budget.target_tokens if budget.target_tokens is not None else "",
            "priced_micro_batch": micro_batch if micro_batch is not None else "",
            "tokens_per_step": tokens, "steps_needed": steps, "step_time_used_s": step_time_s,
            "step_time_source": step_time_source, "wall_clock_h": wall_h, "deadline_h": budget.deadline_s / 3600,
            "meets_deadline": on_time, "late_by_h": late_h, "over_budget_bytes": over,
            "gpu_hours": gpu_hours, "meets_both": bool(fits and on_time),
            "verdict": verdict(fits, on_time, over, late_h)}


def verdict(fits: bool, on_time: bool, over_bytes: int, late_h: float) -> str:
    if fits and on_time:
        return "meets both"
    why = ([] if fits else [f"OOM by {format_bytes(over_bytes, 'GiB')}"]) + \
        ([] if on_time else [f"late by {format_hours(late_h)}"])
    return "; ".join(why)


def format_hours(hours: float) -> str:
    """'8.04 h'; under an hour in minutes ('12.5 min'), under a minute in seconds ('1.51 s')."""
    if hours >= 1:
        return f"{hours:,.2f} h"
    return f"{hours * 60:.3g} min" if hours * 60 >= 1 else f"{hours * 3600:.3g} s"


INVALID = "invalid (see error)"


def _number(x: float) -> str:
    """'643.52', '1,234.50'; under 1, three significant digits ('0.0312'), so short runs do not print as 0.00."""
    return f"{x:,.2f}" if x >= 1 else f"{x:.3g}"


def rank_points(rows: list[dict]) -> list[int]:
    """Row indices, best first: meeting both by GPU-hours (then wall-clock, then grid order); then fitting but
    late, least late first (then GPU-hours); then over the memory budget, smallest excess first (then least
    late, then GPU-hours); then invalid rows (an `error`), in grid order. `rows` are sweep results with the
    deadline columns."""
    def key(i: int):
        r = rows[i]
        if r.get("error") or r.get("verdict") in ("", None, INVALID):
            return (3, 0, 0.0, 0.0, i)
        if r["meets_both"]:
            return (0, r["gpu_hours"], r["wall_clock_h"], 0.0, i)
        if not r["over_budget_bytes"]:
            return (1, r["late_by_h"], r["gpu_hours"], 0.0, i)
        return (2, r["over_budget_bytes"], r["late_by_h"], r["gpu_hours"], i)

    return sorted(range(len(rows)), key=key)


def render_ranking(points: list[tuple[dict, dict]], budget: DeadlineBudget, unit: str | None = None) -> str:
    """The ranked table the CLI prints: each point's grid values, capacity needed vs its memory budget, step
    time, steps, wall-clock, GPU-hours and verdict, best first; a closing line that names the answer."""
    order = sorted(range(len(points)), key=lambda i: points[i][1].get("deadline_rank") or len(points) + i)
    keys = list(points[0][0]) if points else []
    # the point's memory, then the price: with max-batch, of the micro-batch it was priced at ("priced mb"; the
    # grid's otherwise, no column)
    priced = any(r.get("max_micro_batch") not in ("", None) for _, r in points)
    g = Scale.of([r[c] for _, r in points if not r.get("error") for c in ("capacity_needed_bytes", "budget_bytes")],
                 unit)  # one unit for both size columns
    t = Scale.of([r["step_time_used_s"] for _, r in points if not r.get("error")], kind="seconds")
    head = ["rank", *keys, f"needs {g.unit}", f"budget {g.unit}", *(["priced mb"] if priced else []),
            f"step {t.unit}", "steps", "wall h", "GPU-h", "verdict"]
    lines = [head]
    for i in order:
        values, r = points[i]
        grid = [str(values[k]) for k in keys]
        mb = [str(r.get("priced_micro_batch", "")) or "-"] if priced else []
        if r.get("error"):
            lines.append([str(r.get("deadline_rank", "")), *grid, "-", "-", *mb, "-", "-", "-", "-", INVALID])
            continue
        lines.append([str(r["deadline_rank"]), *grid, g.number(r["capacity_needed_bytes"]),
                      g.number(r["budget_bytes"]), *mb, t.number(r["step_time_used_s"]),
                      f"{r['steps_needed']:,}", _number(r["wall_clock_h"]), _number(r["gpu_hours"]), r["verdict"]])
    widths = [max(len(row[c]) for row in lines) for c in range(len(head))]
    text = [budget.describe(unit)]
    text += ["  ".join(cell.ljust(w) if c == len(head) - 1 else cell.rjust(w) if c and c > len(keys) else
                       cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in lines]
    winners = [i for i in order if points[i][1].get("meets_both") is True]
    if winners:
        best = points[winners[0]]
        setting = ", ".join(f"{k}={v}" for k, v in best[0].items())
        text.append(f"{len(winners)} of {len(points)} {'meets' if len(winners) == 1 else 'meet'} both; cheapest: "
                    f"{setting or 'the base scenario'} "
                    f"({_number(best[1]['gpu_hours'])} GPU-hours, {_number(best[1]['wall_clock_h'])} h)")
    else:
        text.append(f"none of {len(points)} meets both the memory budget and the deadline")
    return "\n".join(text)


__all__ = ["DeadlineBudget", "deadline_budget", "parse_duration", "parse_count", "tokens_per_step", "steps_needed",
           "steady_step_seconds", "plan_point", "verdict", "rank_points", "render_ranking", "format_hours",
           "parse_amount", "check_sweep", "point_budget", "DURATION_FORMS", "COUNT_FORMS", "MIN_DURATION_S",
           "MAX_DURATION_S"]
