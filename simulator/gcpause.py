"""`paused_gc()`: the cyclic garbage collector paused for a block of work that makes many objects and no cycles.

A describe, a simulation or a summary makes hundreds of thousands of long-lived objects (blocks, ops, events),
none of them in a reference cycle that must be broken early. While they pile up, the collector's generation-2
passes walk all of them again and again: seconds of a large run. Paused, nothing is walked until the block ends;
reference counting frees as usual. At the end the collector, if it was on, is turned back on, and what the
young generations hold is first moved to the oldest (`gc.freeze()` then `gc.unfreeze()`, two list splices):
otherwise the first allocation after the block would walk every object the block made in one young-generation
pass. (Not done when something else froze objects before: unfreezing would let go of them.) Nested pauses keep
it off until the outermost ends.

Objects moved so are not counted by CPython's rule for a full collection (one runs once the objects that survived
the young collections since the last full one pass a quarter of those it left: Python/gc.c, `long_lived_pending`,
CPython 3.11), so a process that runs many paused blocks (a sweep's worker, a max-batch search, explain's fixes)
would never collect what reference cycles leave: 2,000 tiny sweep points in one process grew to 754 MB. Here,
when an outermost block starts and an upper bound of the objects the collector tracks (the last count plus each
block's net growth, O(1)) has passed GROWTH times what the last full collection left (before any: what the process
held at its first block, counted then: its imports and the caller's own objects, which no collection would free)
and FLOOR, they are counted (`_tracked`), and a full collection runs if the count has passed it too. (With FLOOR
alone, a process that had imported torch and transformers, 600,000 objects, passed it with its first few traced
runs and paid a full collection of half a second that freed 5% of them: docs/models.md's example, in explain's
two processes.) What a run drops is freed by reference counting (the describers' builders and the allocator model
cut their own cycles when done: builder.py `close`, allocator/core.py `close`), so the count grows only by what is
live or cyclic: a command's runs, however large (the 2,048-rank Llama-3-70B pipeline holds 4 million objects at
once, an 8B explain makes 37 runs), never pay for one unless they leave garbage in cycles, and then once it passes
the mark, at the next block's start.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

# this process's: the objects its last full collection left (or its first block found); at most how many are tracked
# now (the last count, plus each block's net growth since: gc.get_count()[0], allocations less deallocations of
# tracked objects, read in O(1))
_COUNTS = {"long_lived": 0, "bound": 0}
GROWTH = 4.0  # a full collection once the objects tracked pass this multiple of those the last one left,
FLOOR = 1_000_000  # and this many


def _tracked() -> int:
    """Every object the collector tracks, counted: moved into one generation, counted, moved back to the oldest
    (a walk of the list, no object made: ~50 ms a million)."""
    gc.freeze()
    n = gc.get_freeze_count()
    gc.unfreeze()
    return n


@contextmanager
def paused_gc():
    enabled = gc.isenabled()  # (off: a block inside another, or a caller's own pause)
    if enabled and not _COUNTS["long_lived"] and gc.get_freeze_count() == 0:  # the process's first block
        _COUNTS["long_lived"] = _COUNTS["bound"] = _tracked()
    mark = max(GROWTH * _COUNTS["long_lived"], FLOOR)
    if enabled and gc.get_freeze_count() == 0 and _COUNTS["bound"] > mark:
        _COUNTS["bound"] = _tracked()  # the bound passed the mark: count them
        if _COUNTS["bound"] > mark:
            gc.collect()  # what earlier blocks left in reference cycles, collected before this one adds to it
            _COUNTS["long_lived"] = _COUNTS["bound"] = _tracked()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                _COUNTS["bound"] += gc.get_count()[0]  # the block's net growth (the collector was off throughout)
                gc.freeze()  # the young generations moved to the oldest (two list splices)
                gc.unfreeze()
            gc.enable()


def gc_paused(fn):
    """`fn` run under `paused_gc()` (a decorator)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused_gc():
            return fn(*args, **kwargs)
    return wrapper
