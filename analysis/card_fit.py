"""One verdict of a run against a card: does it fit, and by what figure it is judged.

Every command that says "fits" (simulate --check, where, explain's fixes, max-batch, the GPU counts of
peakledger/gpus.py) reads it here, so the figure a command prints is the figure it judged:

- the need is the worst rank's device total with no bound on the allocator (CUDA context + reserved segments +
  what lies outside the allocator; on the cpu profile the tensors' peak), x (1 + headroom); it fits when that is
  within the budget;
- on a CUDA profile without headroom, a run over the budget still fits when the caching allocator, bounded by the
  budget, serves every request of every rank by freeing its whole cache and retrying (c10/cuda/
  CUDACachingAllocator.cpp `malloc`: release_cached_blocks then alloc_block again, counted in num_alloc_retries,
  torch 2.6 to 2.13). The judged figures are then that bounded run's (its worst rank's device total), the
  verdict says so, with the retries and what the unbounded run would hold;
- a margin under THIN_MARGIN of the budget is thin: it fits, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.device_memory import DeviceMemory, DevicePoint
from ..simulator.events import EventLog
from .device import cuda_profile, gpu_memory
from .peaks import with_headroom

THIN_MARGIN = 0.02  # a fit with less than this share of the budget left is thin (a warning, not a refusal)


@dataclass(frozen=True)
class CardFit:
    """A run against `budget` bytes per rank (see the module docstring)."""

    fits: bool
    need: int  # the figure judged, x (1 + headroom)
    budget: int
    rank: int  # the rank judged (the worst)
    unbounded: int  # what the worst rank needs with the allocator unbounded, x (1 + headroom)
    point: DevicePoint | None = None  # CUDA profiles: the judged rank's device-total peak (context / reserved split)
    alloc_retries: int = 0  # requests served only after a flush, on the judged rank (torch's num_alloc_retries)

    @property
    def by_retry(self) -> bool:
        """Fits only because the allocator frees its cache and retries (the figures are the bounded run's)."""
        return self.fits and self.unbounded > self.budget

    @property
    def margin(self) -> int:
        """budget - need: what is left (negative: short by that much)."""
        return self.budget - self.need

    @property
    def thin(self) -> bool:
        return self.fits and self.margin < THIN_MARGIN * self.budget


def _replays(log: EventLog, capacity: int | None, known: DeviceMemory | None = None) -> list[DeviceMemory]:
    """Each rank of the log through the allocator, bounded by `capacity` (None: unbounded), stopping at its OOM;
    `known`, one rank's replay under the same bound already made, is taken as it is."""
    ranks = sorted({e.block.rank for e in log.events})
    return [known if known is not None and known.rank == r and known.capacity == capacity else
            gpu_memory(log, r, capacity=capacity, unbounded=capacity is None) for r in ranks]


def card_fit(log: EventLog, budget: int, headroom: float, tensors_needed: int,
             replayed: DeviceMemory | None = None) -> CardFit:
    """The verdict of the run in `log` against `budget` per rank; `tensors_needed` is what it needs off a CUDA
    profile (its tensors' peak x (1 + headroom), the report's `capacity_needed`); `replayed`, a rank's replay
    already made (reused where its bound is the one needed)."""
    if cuda_profile(log) is None:
        return CardFit(tensors_needed <= budget, tensors_needed, budget, 0, tensors_needed)
    replays = _replays(log, None, replayed)
    free = max(replays, key=lambda dm: (dm.total_peak.total, -dm.rank))
    unbounded = with_headroom(free.total_peak.total, headroom)
    if unbounded <= budget or headroom:
        return CardFit(unbounded <= budget, unbounded, budget, free.rank, unbounded, free.total_peak)
    # a rank whose live tensors alone pass what the allocator may reserve within the budget (the budget less what
    # lies outside it) stops at an OOM however its cache is freed (reserved >= allocated blocks >= live tensors):
    # the bounded run's verdict, without replaying it
    if any(dm.at_allocated_peak.allocated > max(0, budget - dm.outside_total) for dm in replays):
        return CardFit(False, unbounded, budget, free.rank, unbounded, free.total_peak)
    bounded = _replays(log, budget, replayed)
    if any(dm.oom is not None for dm in bounded):
        return CardFit(False, unbounded, budget, free.rank, unbounded, free.total_peak)
    worst = max(bounded, key=lambda dm: (dm.total_peak.total, -dm.rank))
    return CardFit(True, worst.total_peak.total, budget, worst.rank, unbounded, worst.total_peak,
                   worst.alloc_retries)


__all__ = ["CardFit", "card_fit", "THIN_MARGIN"]
