"""One piece of work in a forked process, beside this one: a trace or a compile is one Python thread, so on a machine of
two or more cores a second one runs in a child forked from this process while this process does another.

`forked(work)` forks (Linux only: a fork of a process with torch loaded is safe there), runs `work()` in the child and
returns a function that gives its result, sent back pickled through a pipe, or None: no fork on this platform or one
core only (`worth_forking`), the child failed for whatever reason, or it stalled (alive, no CPU used for `STALL_S`: a
deadlock), in which case it is killed. The caller then does the work itself, so the answer is the same either way;
only the wall time differs. The child ends with `os._exit` (no atexit handler of the parent's runs twice) and enters
no OpenMP region (one intra-op thread): an OpenMP pool the parent made before the fork (any real op it ran on several
threads) has no threads in the child, and a parallel region would wait for them forever (libgomp; measured: a hang in
a real `zeros`); one thread enters none (aten/src/ATen/ParallelOpenMP.h `parallel_for`: `get_num_threads() > 1`).
Used by models/traced (the two shallow traces of a depth derivation) and models/compile/fork.py (a window's deepest
compile).

`shared_map(fn, items)` is `[fn(x) for x in items]` with the items shared out between this process and one forked
child as each takes the next one not taken (a counter in shared memory), so that pieces of work of unequal length
keep both cores busy (explain's re-simulated fixes: peakledger/diagnosis.py). What the child could not do (it
failed, stalled, or `fn` raised there) this process does itself, so that the results, and any exception `fn`
raises, are those of the plain loop; `done(i, item)` is called here once per item, in the order this process
learns that it is done (the child's items when its answers arrive). A shared_map inside one (a trace among explain's
fixes) is a plain loop, in whichever process runs the outer item: both cores are busy already, and a third process
would only add a fork of a large process and its copied pages."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

STALL_S = 60.0  # a child that has used no CPU for this long is stuck (a trace or a compile is busy Python throughout)
ENV = "PEAKLEDGER_FORK"  # "0": never fork (every piece of work in this process)


_SHARING = [False]  # a shared_map is sharing its items out now (this process, or the child it forked)


def worth_forking() -> bool:
    """A fork can run beside this process: Linux, two or more usable cores, not turned off by $PEAKLEDGER_FORK=0."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV) == "0":
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


def one_intra_op_thread() -> None:
    """In a forked child: torch (where loaded) on one intra-op thread, entering no OpenMP region (module docstring)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def answers(reader, process) -> bool:
    """Wait for the child's answer; False where it stalls: alive but no CPU used for `STALL_S` (a deadlock, as
    libgomp's was), so that the caller does the work itself instead of waiting forever."""
    used, since = cpu_seconds(process.pid), time.monotonic()
    while not reader.poll(min(1.0, STALL_S)):
        if not process.is_alive():
            return reader.poll(0)
        now = cpu_seconds(process.pid)
        if now is None or now != used:
            used, since = now, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            return False
    return True


def forked(work: Callable[[], Any]) -> Callable[[], Any]:
    """Start `work()` in a forked child (see the module docstring); the returned function waits for its result and
    gives it, or None."""
    if not worth_forking():
        return lambda: None
    import multiprocessing

    try:
        context = multiprocessing.get_context("fork")
        reader, writer = context.Pipe(duplex=False)
    except (ValueError, OSError):  # no fork on this platform
        return lambda: None

    def child() -> None:
        try:
            one_intra_op_thread()
            writer.send(("ok", work()))
        except BaseException as e:  # noqa: BLE001 (reported to the parent, which does the work itself)
            writer.send(("error", repr(e)))
        finally:
            os._exit(0)

    process = context.Process(target=child, daemon=True)
    try:
        process.start()
    except (OSError, AssertionError):  # AssertionError: this process is a daemon (a pool's worker), which has none
        return lambda: None
    writer.close()

    def result() -> Any:
        try:
            kind, value = reader.recv() if answers(reader, process) else ("stalled", None)
        except (EOFError, OSError):
            kind, value = "error", None
        finally:
            if process.is_alive():
                process.kill()
            process.join()
            reader.close()
        return value if kind == "ok" else None

    return result


def shared_map(fn: Callable[[Any], Any], items: Sequence[Any],
               done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """`[fn(x) for x in items]`, the items shared with a forked child (see the module docstring)."""
    items = list(items)
    note = done or (lambda i, item: None)
    if len(items) < 2 or not worth_forking() or _SHARING[0]:
        out = []
        for i, item in enumerate(items):
            out.append(fn(item))
            note(i, item)
        return out
    import multiprocessing

    counter = multiprocessing.get_context("fork").Value("q", 0)  # the next item not taken (a lock with it)

    def take() -> int:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i

    def theirs() -> dict[int, Any]:
        got: dict[int, Any] = {}
        while (i := take()) < len(items):
            try:
                got[i] = fn(items[i])
            except Exception:  # noqa: BLE001 (not sent: done again here, where it raises as in the plain loop)
                continue
        return got

    _SHARING[0] = True  # (a shared_map inside: its items done in a plain loop, here and in the child)
    try:
        pending = forked(theirs)
        ours: dict[int, Any] = {}
        try:
            while (i := take()) < len(items):
                ours[i] = fn(items[i])
                note(i, items[i])
        except BaseException:
            with counter.get_lock():
                counter.value = len(items)  # the child takes no more
            pending()
            raise
    finally:
        _SHARING[0] = False
    child = pending() or {}
    for i in sorted(child):
        note(i, items[i])
    for i in range(len(items)):  # what the child took and did not send back
        if i not in ours and i not in child:
            ours[i] = fn(items[i])
            note(i, items[i])
    return [ours[i] if i in ours else child[i] for i in range(len(items))]


__all__ = ["forked", "shared_map", "one_intra_op_thread", "worth_forking", "answers", "cpu_seconds", "STALL_S", "ENV"]
