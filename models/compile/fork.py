"""A compile in a forked process: depth.py's first window compiles three depths of one model, and a compile is one
Python thread, so its deepest compile runs in a child forked from this process (Linux: a fork of a process with torch
loaded is safe there only) while this one compiles the two others on the other core. The child gives its capture
back through a pipe, its GEMM scratchpads as markers (workspace.py `markers_only`: it starts no probe, the probing
process and its pipes being the parent's) that become the parent's markers here; a child that fails, for whatever
reason, gives None and the caller compiles that depth itself: the result is the same either way."""

from __future__ import annotations

from ..config import TrainingSetup
from ..trace.model import TracedModel
from . import workspace
from .capture import Capture
from .plan import marker_of, scratch_alloc


def forked_compile(compile_capture, model: TracedModel, setup: TrainingSetup):
    """Start `compile_capture(model, setup)` (capture.py's, as the caller names it) in a forked process (a compile
    is one Python thread: the other core takes it), and return a function giving its capture, its GEMM markers made
    this process's (workspace.py `markers_only`: the child starts no probe), or None where the child failed (the
    caller compiles it here)."""
    import multiprocessing
    import os
    import sys

    if not sys.platform.startswith("linux"):  # fork of a process with torch loaded: safe on Linux only
        return lambda: None
    try:
        context = multiprocessing.get_context("fork")
        reader, writer = context.Pipe(duplex=False)
    except (ValueError, OSError):  # no fork on this platform
        return lambda: None

    def child() -> None:
        try:
            import torch

            # an OpenMP pool the parent made before the fork (any real op it ran on several threads) has no threads
            # here: a parallel region would wait for them forever (libgomp; measured: a hang in a real `zeros`); one
            # thread enters none (aten/src/ATen/ParallelOpenMP.h `parallel_for`: `get_num_threads() > 1`)
            torch.set_num_threads(1)
            workspace.markers_only()
            with workspace.deferred():
                cap = compile_capture(model, setup)
            writer.send(("ok", cap, workspace.markers_given()))
        except BaseException as e:  # noqa: BLE001 (reported to the parent, which compiles it itself)
            writer.send(("error", repr(e), []))
        finally:
            os._exit(0)

    process = context.Process(target=child, daemon=True)
    try:
        process.start()
    except OSError:
        return lambda: None
    writer.close()

    def result() -> Capture | None:
        try:
            kind, cap, given = reader.recv()
        except (EOFError, OSError):
            kind = "error"
        finally:
            process.join()
            reader.close()
        if kind != "ok" or not isinstance(cap, Capture):
            return None
        for plan in cap.plans:  # the child's markers, numbered in its process: this process's numbers
            plan.events = [ev if marker_of(ev) is None else
                           scratch_alloc(ev[1], workspace.marker(*given[-marker_of(ev) - 1]))
                           for ev in plan.events]
        return cap

    return result


__all__ = ["forked_compile"]
