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
CPython 3.11), so a process that runs many paused blocks (a sweep's worker, a max-batch search) never collected
what their reference cycles leave: 2,000 tiny sweep points in one process grew to 754 MB. Here the blocks' moved
objects are counted (`pending`) and a full collection runs once they pass GROWTH times what the last one left and
FLOOR: the same 2,000 points stay at 151 MB in 10.8 s (8.9 s never collecting; 10.2 s and 74 MB collecting every
64 points, as the sweep's workers did before), and one command's run never pays for one.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

_COUNTS = {"long_lived": 0, "pending": 0}  # this process's: objects its last full collection left, objects moved since
GROWTH = 4.0  # a full collection once the objects moved since the last one pass this share of those it left,
FLOOR = 1_000_000  # and this many: one command's run (a Llama-3-70B preset moves ~230,000) never pays for one


@contextmanager
def paused_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                _COUNTS["pending"] += len(gc.get_objects(0)) + len(gc.get_objects(1))  # what moves now
                gc.freeze()
                gc.unfreeze()
                if _COUNTS["pending"] > max(GROWTH * _COUNTS["long_lived"], FLOOR):
                    gc.collect()
                    gc.freeze()
                    _COUNTS.update(long_lived=gc.get_freeze_count(), pending=0)
                    gc.unfreeze()
            gc.enable()


def gc_paused(fn):
    """`fn` run under `paused_gc()` (a decorator)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused_gc():
            return fn(*args, **kwargs)
    return wrapper
