"""A compile in a forked process: depth.py's first window compiles three depths of one model, and a compile is one
Python thread, so its deepest compile runs in a child forked from this process (models/forked.py `forked`) while this
one compiles the two others on the other core. The child gives its capture back through a pipe, its GEMM scratchpads
as markers (workspace.py `markers_only`: it starts no probe, the probing process and its pipes being the parent's)
that become the parent's markers here; a child that fails or stalls, for whatever reason, gives None and the caller
compiles that depth itself: the result is the same either way."""

from __future__ import annotations

from ..config import TrainingSetup
from ..forked import forked
from ..traced.model import TracedModel
from . import workspace
from .capture import Capture
from .plan import marker_of, scratch_alloc


def forked_compile(compile_capture, model: TracedModel, setup: TrainingSetup):
    """Start `compile_capture(model, setup)` (capture.py's, as the caller names it) in a forked process, and return a
    function giving its capture, its GEMM markers made this process's (workspace.py `markers_only`: the child starts
    no probe), or None where the child failed (the caller compiles it here)."""
    def work() -> tuple[Capture, list]:
        workspace.markers_only()
        with workspace.deferred():
            cap = compile_capture(model, setup)
        return cap, workspace.markers_given()

    pending = forked(work)

    def result() -> Capture | None:
        got = pending()
        if got is None or not isinstance(got[0], Capture):
            return None
        cap, given = got
        for plan in cap.plans:  # the child's markers, numbered in its process: this process's numbers
            plan.events = [ev if marker_of(ev) is None else
                           scratch_alloc(ev[1], workspace.marker(*given[-marker_of(ev) - 1]))
                           for ev in plan.events]
        return cap

    return result
