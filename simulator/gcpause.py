"""`paused_gc()`: the cyclic garbage collector paused for a block of work that makes many objects and no cycles.

A describe, a simulation or a summary makes hundreds of thousands of long-lived objects (blocks, ops, events),
none of them in a reference cycle that must be broken early. While they pile up, the collector's generation-2
passes walk all of them again and again: seconds of a large run. Paused, nothing is walked until the block ends;
reference counting frees as usual. At the end the collector, if it was on, is turned back on, and what the
young generations hold is first moved to the oldest (`gc.freeze()` then `gc.unfreeze()`, two list splices),
where the next full collection looks at it as usual: otherwise the first allocation after the block would walk
every object the block made in one young-generation pass. (Not done when something else froze objects before:
unfreezing would let go of them.) Nested pauses keep it off until the outermost ends."""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager


@contextmanager
def paused_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def gc_paused(fn):
    """`fn` run under `paused_gc()` (a decorator)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused_gc():
            return fn(*args, **kwargs)
    return wrapper
