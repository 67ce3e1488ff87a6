"""Peaks: the true peak of a run, the first-step and steady-state (step >= 2) peaks, and headroom.

A peak is the highest occupancy of one (rank, pool) reached right after an event; it carries that
event (so the op, phase and step that caused it) and the live bytes by category at that moment.
The steady-state peak is what every step after the first needs; the first-step peak includes the load.
In the plain loop the first step is never above the steady state: the optimizer states torch creates
lazily inside the first step() stay for every later step (measured on real runs, tests/
test_optimizer_offload.py), so an OOM "at the first optimizer step" is the first moment the full state
exists, and would recur. The first step is above the steady state when something exists in it alone:
a load transient, or an optimizer-state offload whose first step creates every state on the device
before it can move any to the host (models/optimizers.py); `transient` is then worth naming.

A simulated log may hold only the steps that differ (models/training.StepPlan): the later steps repeat
them, so every peak here, taken on the simulated steps, is the whole run's, at the same event (a repeat
reaches a height only after its source did, and ties go to the first moment).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..simulator.events import EventLog, Pool
from ..simulator.timeline import PeakPoint, Timeline, timeline


@dataclass(frozen=True)
class Peaks:
    rank: int
    pool: Pool
    overall: PeakPoint  # the whole run's (every step)
    first_step: PeakPoint
    steady: PeakPoint | None  # None when the run has a single step
    headroom: float

    @property
    def capacity_needed(self) -> int:
        """peak x (1 + headroom), rounded up to a whole byte (exact integer arithmetic)."""
        return with_headroom(self.overall.bytes, self.headroom)

    @property
    def transient(self) -> int:
        """How far the true peak is above the steady-state peak (0 when the steady state is the peak)."""
        return self.overall.bytes - self.steady.bytes if self.steady else 0


def with_headroom(nbytes: int, headroom: float) -> int:
    """nbytes x (1 + headroom), rounded up, in exact integer arithmetic (headroom to 1e-6)."""
    ratio = Fraction(1 + headroom).limit_denominator(10**6)
    return -(-nbytes * ratio.numerator // ratio.denominator)


def peaks(log: EventLog | Timeline, rank: int = 0, pool: Pool = Pool.DEVICE, headroom: float = 0.0) -> Peaks:
    tl = log if isinstance(log, Timeline) else timeline(log, rank, pool)
    steps = np.array([e.step for e in tl.events], dtype=np.int64)
    steady = tl.peak_in(steps >= 2) if (steps >= 2).any() else None
    return Peaks(rank=tl.rank, pool=tl.pool, overall=tl.peak_in(), first_step=tl.peak_in(steps <= 1),
                 steady=steady, headroom=headroom)
