"""A script runs in a forked child process, for the prediction and the measurement alike.

A script changes the process it runs in: its libraries' modules are imported there (and a module first imported
under fake tensors keeps the fake constants it made at import), torch's global settings (default dtype, threads,
seeds, deterministic flags) are the script's, the atexit handlers it registers stay. Run in a fork of the caller,
every run starts from the caller's state and leaves it as it was, and the prediction and the measurement of one
script start from the same state (the same modules already imported), so what they count is the same program.

`in_child(fn, *args)` returns `fn(*args)` from a forked child (its result pickled back through a pipe); an input
error there is raised here as the same `InputError` (exit 2 for the CLI), a child that dies (a signal, the
kernel's out-of-memory killer, `os._exit` past the boundary) is a ConfigError naming how it died, any other error
in the child a RuntimeError with its message (an internal error).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

from ...simulator.safe_io import InputError
from ..config import ConfigError
from ..forked import one_intra_op_thread

POLL_S = 0.5  # the parent wakes this often, so Ctrl-C and SIGTERM are handled while it waits
STOP_S = 2.0  # a child's time to end after SIGTERM before SIGKILL


def _child(conn, fn: Callable, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the child
    one_intra_op_thread()  # (models/forked.py: a real op's OpenMP region would wait forever for the parent's pool;
    # seen: a script's real sdpa in the child of a test process that had run real ops)
    try:
        result = ("ok", fn(*args))
    except InputError as e:
        result = ("input", (type(e).__name__, e.field, e.message))
    except BaseException as e:  # noqa: BLE001 (whatever the child raised goes back as text)
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        conn.send(result)
    finally:
        conn.close()
        os._exit(0)


def in_child(fn: Callable, *args):
    """`fn(*args)` run in a forked child process (module docstring)."""
    return in_children([(fn, args)])[0]


def in_children(calls: list[tuple[Callable, tuple]]) -> list:
    """Each `fn(*args)` of `calls` in its own forked child, all at once (the ranks of a distributed run talk to
    each other), their results in order; the first failure is raised once every child has ended."""
    ctx = multiprocessing.get_context("fork")
    running = []
    for fn, args in calls:
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
        process.start()
        child.close()
        running.append((parent, process))
    results: list = [None] * len(running)
    try:
        while any(r is None for r in results):
            waiting = [k for k, r in enumerate(results) if r is None]
            ready = wait([x for k in waiting for x in (running[k][0], running[k][1].sentinel)], timeout=POLL_S)
            for k in waiting:
                parent, process = running[k]
                if parent in ready:
                    try:
                        results[k] = parent.recv()
                    except EOFError:
                        results[k] = ("died", None)
                elif process.sentinel in ready and not parent.poll():
                    results[k] = ("died", None)
            if any(r is not None and r[0] != "ok" for r in results):
                break  # one failed: the others (its peers, waiting on it) are stopped below
    finally:
        for parent, process in running:
            parent.close()
            process.join(timeout=STOP_S if all(r is not None for r in results) else 0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=STOP_S)
                if process.is_alive():
                    process.kill()
                    process.join()
    for (_, process), result in zip(running, results):
        if result is not None and result[0] != "ok":
            _raise(result, process)
    return [value for _, value in results]


def _raise(result: tuple, process) -> None:
    kind, value = result
    if kind == "input":
        name, field, message = value
        raise ConfigError(field, message)
    if kind == "died":
        code = process.exitcode
        how = f"was killed by signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else \
            f"exited with status {code}"
        hint = " (the out-of-memory killer sends SIGKILL: the run took more memory than this machine has)" \
            if code == -signal.SIGKILL else ""
        raise ConfigError("script", f"the process running the script {how}{hint}")
    raise RuntimeError(f"in the process running the script: {value}")
