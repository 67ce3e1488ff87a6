"""A sweep's signals: Ctrl-C and SIGTERM stop it cleanly on every engine (see the package docstring), and a
cluster's life runs in a helper thread whose processes never see a terminal's Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

POLL_S = 0.1  # seconds between looks at a cluster's progress (and at signals)


class Interrupts:
    """During a sweep SIGTERM raises KeyboardInterrupt, like Ctrl-C, so one clean-up serves both (a SIGTERM
    handler the caller installed, such as the CLI's, is kept instead; only the main thread has handlers)."""

    def __enter__(self) -> Interrupts:
        main = threading.current_thread() is threading.main_thread()
        self.installed = main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        if self.installed:
            self.previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def in_helper_thread(start: Callable[[], None], stop: Callable[[], None], timeout_s: float | None = None,
                     on_timeout: Callable[[], BaseException] | None = None, hold: bool = True) -> Iterator[None]:
    """A cluster's life in a helper thread that blocks SIGINT: start() there, the block's body here, then stop()
    there. Why a thread: the processes it starts inherit the mask (through fork and exec), so a terminal's
    Ctrl-C, which reaches the whole process group, gives them no traceback; ray ties the processes it starts
    to the life of the starting thread (PR_SET_PDEATHSIG), so that thread lives until stop(); and off the main
    thread ray.init leaves the process's SIGTERM handler alone.

    hold=True (a local cluster): an interrupt (Ctrl-C, SIGTERM) while the cluster starts or stops is held until
    it is done, so none is left half-started; a second one (or one during the stop of an interrupted sweep)
    stops waiting. hold=False (a connection to an existing cluster, which leaves nothing behind): an interrupt
    while it starts stops waiting at once. Either way, a start that has not finished after `timeout_s` raises
    on_timeout() here (the library itself may hang): the helper is left to finish in the background (a daemon
    thread) and to run stop() then; the process's exit ends it, and a local cluster's processes with it
    (PR_SET_PDEATHSIG, ray) or at their scheduler's loss (dask)."""
    ready, finish = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def life() -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            start()
        except BaseException as e:  # raised in the caller's thread
            errors.append(e)
        ready.set()
        if not errors:
            finish.wait()
        try:
            stop()  # whatever start() made, even half of it
        except Exception as e:  # raised in the caller's thread
            errors.append(e)

    helper = threading.Thread(target=life, name="peakledger-sweep-cluster", daemon=True)
    helper.start()
    abandoned = False
    try:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            wait(lambda t: ready.wait(t if end is None else max(0.0, min(t, end - time.monotonic())))
                 or (end is not None and time.monotonic() >= end), hold=hold)
        except BaseException:
            abandoned = not ready.is_set()
            raise
        if not ready.is_set():  # timed out
            abandoned = True
            raise on_timeout() if on_timeout is not None else TimeoutError(f"no cluster after {timeout_s} s")
        if errors:
            raise errors[0]
        yield
    finally:
        finish.set()
        if not abandoned:
            wait(lambda timeout: helper.join(timeout) or not helper.is_alive(), hold=sys.exc_info()[0] is None)
    if errors:
        raise errors[0]


def wait(done, hold: bool) -> None:
    """Wait until done(timeout) is true, in short waits so that signals are handled. hold=True: the first
    interrupt is raised only once done, a second one at once; hold=False: any interrupt at once."""
    held = None
    while True:
        try:
            if done(POLL_S):
                break
        except BaseException as e:  # Ctrl-C, or a SIGTERM handler's exception
            if not hold or held is not None:
                raise
            held = e
    if held is not None:
        raise held


@contextlib.contextmanager
def blocked(*signums: int):
    """Block signals in this thread while it forks workers (they inherit the mask); one that comes meanwhile
    is delivered when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signums)) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class SigtermBetweenCalls:
    """While ray runs a sweep, a SIGTERM only sets a flag, and `check()` (between ray calls) and the exit
    raise it through the handler it replaced (ours, or the caller's with its own exception): an exception
    raised inside ray's C code comes out as a bare KeyboardInterrupt (ray/_raylet.pyx, check_status), which
    would turn the CLI's "terminated" into "interrupted". Installing a handler also takes SIGTERM back
    from ray's core worker, which puts its own C-level one in the driver process (it prints `*** SIGTERM
    received ***`). Only the main thread has handlers; elsewhere nothing changes."""

    def __enter__(self) -> SigtermBetweenCalls:
        self.seen = False
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.seen = True

    def check(self) -> None:
        if self.seen:
            self.seen = False
            if callable(self.handler):
                self.handler(signal.SIGTERM, None)
            if self.handler != signal.SIG_IGN:
                raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *exc) -> None:
        if self.main:
            signal.signal(signal.SIGTERM, self.handler if self.handler is not None else signal.SIG_DFL)
        self.check()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")



__all__ = ["POLL_S", "Interrupts", "in_helper_thread", "wait", "blocked", "SigtermBetweenCalls"]
