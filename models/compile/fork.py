"""A compile in a forked process: depth.py's first window compiles three depths of one model, and a compile is one
Python thread, so its deepest compile runs in a child forked from this process (Linux: a fork of a process with torch
loaded is safe there only) while this one compiles the two others on the other core. The child gives its capture
back through a pipe, its GEMM scratchpads as markers (workspace.py `markers_only`: it starts no probe, the probing
process and its pipes being the parent's) that become the parent's markers here; a child that fails, for whatever
reason, gives None and the caller compiles that depth itself: the result is the same either way. So does a child
that stalls (alive, no CPU used for `STALL_S`: a deadlock), which is killed."""

from __future__ import annotations

from ..config import TrainingSetup
from ..traced.model import TracedModel
from . import workspace
from .capture import Capture
from .plan import marker_of, scratch_alloc

STALL_S = 60.0  # a child that has used no CPU for this long is stuck (a compile is busy Python throughout)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc), or None where unreadable."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _answers(reader, process) -> bool:
    """Wait for the child's answer; False where it stalls: alive but no CPU used for `STALL_S` (a deadlock, as
    libgomp's was), so that the caller compiles the depth itself instead of waiting forever."""
    import time

    used, since = _cpu_seconds(process.pid), time.monotonic()
    while not reader.poll(min(1.0, STALL_S)):
        if not process.is_alive():
            return reader.poll(0)
        now = _cpu_seconds(process.pid)
        if now is None or now != used:
            used, since = now, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            return False
    return True


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
            kind, cap, given = reader.recv() if _answers(reader, process) else ("stalled", None, [])
        except (EOFError, OSError):
            kind = "error"
        finally:
            if process.is_alive():
                process.kill()
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
