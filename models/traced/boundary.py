"""The boundary around a user's code (a `--module` file: its import, its factory, its model's forward and loss).

Whatever the code does, peakledger keeps the process and its output:
- `sys.exit(n)` / `SystemExit`, any other `BaseException` but Ctrl-C, and `os._exit(n)` (replaced while the code
  runs) become a ConfigError naming the code, exit 2;
- what it prints goes to stderr, so stdout stays the command's output (`--json` stays JSON);
- it runs for at most the limit (`time_limit`, SIGALRM, on the main thread; 0 = none): a factory that hangs in Python
  code ends with exit 2 naming it (one stuck inside a C call ends when that call returns);
- with `real_bytes`, the real memory it takes is measured (the process's resident size, now and at its peak,
  before and after): a
  factory runs under peakledger's fake mode, so one that takes more made real tensors outside it (a numpy array,
  `torch.from_numpy`, a tensor made at import) and is refused, naming it and what it took;
- the processes it starts (and theirs, daemons included) are the user's, ended when the command ends, not when the
  block does (a helper the factory starts may serve the forward): `end_user_processes` (processes.py; Linux, else a
  no-op), which the CLI calls as a command ends and atexit at exit; peakledger's own code run inside a block (a hook
  the user's code calls back) starts its processes under `own_processes()`;
- a process it forks never runs peakledger's code after the block: leaving it (returning, raising, `sys.exit`), or
  calling `os._exit`, ends that process there, with the status Python would give it;
- the atexit handlers it registers (`atexit.register` is replaced while it runs; `from atexit import register`
  done then keeps the replacement, which guards whenever it is called) still run at exit, where Python runs them
  (libraries first imported by the user's code register their own cleanup that way), but guarded: `os._exit` and
  `sys.exit` in one end that handler only, never the process, nor change its exit status; an exception in one is one
  line on stderr; what one prints goes to stderr; each runs for at most the block's limit. `atexit.unregister(f)`
  (atexit's own, not replaced) finds a guarded `f`: the guard compares equal to it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from ..config import ConfigError
from .processes import end_user_processes, own_processes, tagged

DEFAULT_SECONDS = 600.0
_limit = [DEFAULT_SECONDS]  # the limit now: `time_limit` (the CLI's --module-timeout), read by `user_code`


REAL_BYTES = 2 << 30  # a factory's (or its module's import's) real memory at most; torch's own import is below


def _rss() -> tuple[int, int]:
    """(resident size now, peak resident size) of the process, in bytes (Linux: /proc/self/statm in pages, and
    ru_maxrss in kilobytes); (0, 0) where neither can be read."""
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = 0
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Within the block, every `user_code` block runs for at most `seconds` (0: no limit; None: the default);
    the previous limit is back after it (a command sets it for itself, never for the next one)."""
    previous = _limit[0]
    _limit[0] = DEFAULT_SECONDS if seconds is None else float(seconds)
    try:
        yield
    finally:
        _limit[0] = previous


class _Exited(BaseException):
    """`os._exit(status)` called by the user's code."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _TimedOut(BaseException):
    pass


def _no_exit(pid: int, real_exit: Callable[[int], NoReturn]) -> Callable[..., NoReturn]:
    """`os._exit` while the user's code runs in process `pid`: raises `_Exited` there; in a process the code forked
    it is `os._exit`."""

    def no_exit(status: int = 0) -> NoReturn:
        if os.getpid() != pid:
            real_exit(status)
        raise _Exited(status)

    return no_exit


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    """Raise `_TimedOut` in the block after `seconds` (SIGALRM; on the main thread only; 0: no limit)."""
    if not (seconds > 0 and threading.current_thread() is threading.main_thread()):
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        raise _TimedOut()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _status(error: BaseException | None) -> int:
    """The exit status Python gives a program that ends with `error` (None: it returned), what it prints printed."""
    if error is None:
        return 0
    if isinstance(error, _Exited):
        return error.status if isinstance(error.status, int) else 1
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    traceback.print_exception(error)
    return 1


class _Guarded:
    """An atexit handler the user's code `what` registered (module docstring), run guarded."""

    def __init__(self, what: str, seconds: float, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.what, self.seconds, self.func, self.args, self.kwargs = what, seconds, func, args, kwargs

    def __eq__(self, other: object) -> bool:  # atexit.unregister(func) compares each handler with func
        try:
            return other is self or bool(self.func == other)
        except Exception:  # the user's __eq__
            return False

    def __hash__(self) -> int:
        return id(self)

    def __call__(self) -> None:
        real_exit = os._exit
        os._exit = _no_exit(os.getpid(), real_exit)
        try:
            with _bounded(self.seconds), contextlib.redirect_stdout(sys.stderr):
                self.func(*self.args, **self.kwargs)
        except (SystemExit, _Exited):  # its exit is not the command's
            pass
        except _TimedOut:
            print(f"peakledger: warning: module: an atexit handler of {self.what} ran for more than "
                  f"{self.seconds:g} s; stopped", file=sys.stderr)
        except BaseException as e:  # the user's: one line
            print(f"peakledger: warning: module: an atexit handler of {self.what} raised {type(e).__name__}: {e}",
                  file=sys.stderr)
        finally:
            os._exit = real_exit


_atexit_register = atexit.register  # atexit's own


def _guarding(what: str, seconds: float) -> Callable[..., Callable[..., Any]]:
    """`atexit.register` while the user's code `what` runs: registers the handler guarded (`_Guarded`)."""

    def register(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if not callable(func):
            raise TypeError("the first argument must be callable")
        _atexit_register(_Guarded(what, seconds, func, args, kwargs))
        return func

    return register


@contextlib.contextmanager
def user_code(what: str, seconds: float | None = None, real_bytes: int = 0, field: str = "module") -> Iterator[None]:
    """Run the block as the user's code `what` (a phrase: "importing x.py", "factory(micro_batch=2)"), for at most
    `seconds` (default: the process's limit), taking at most `real_bytes` of real memory (0: not measured). `field`
    names the input in its errors: "module" (a --module factory), "script" (peakledger run's script)."""
    seconds = _limit[0] if seconds is None else seconds
    before = _rss() if real_bytes else (0, 0)
    pid, real_exit, real_register = os.getpid(), os._exit, atexit.register
    os._exit, atexit.register = _no_exit(pid, real_exit), _guarding(what, seconds or 0)
    try:
        with tagged(), _bounded(seconds or 0), contextlib.redirect_stdout(sys.stderr):
            try:
                yield
            except BaseException as e:
                if os.getpid() != pid:  # a process the code forked leaves the block: it ends here
                    real_exit(_status(e))
                raise
            if os.getpid() != pid:
                real_exit(_status(None))
        after = _rss() if real_bytes else (0, 0)  # what it keeps, or what it took at most on the way
        grown = max(after[0] - before[0], after[1] - before[1])
        if grown > real_bytes:
            raise ConfigError(field, f"{what} took {grown / 2**30:.2f} GiB of real memory: it made real tensors "
                                        "outside peakledger's fake mode (a numpy array, torch.from_numpy, a tensor "
                                        "made at import); make them inside the factory with torch ops")
    except _TimedOut:
        raise ConfigError(field, f"{what} ran for more than {seconds:g} s; " + (
            "a factory builds a model, it does not train it (raise the limit with --module-timeout SECONDS)"
            if field == "module" else "raise the limit with --time-limit SECONDS (0: none)")) from None
    except _Exited as e:
        raise ConfigError(field, f"{what} called os._exit({e.status})" + (
            "; a factory must return (model, batch, loss_fn)" if field == "module" else
            ": a script peakledger runs ends by returning or sys.exit")) from None
    except SystemExit as e:
        raise ConfigError(field, f"{what} called sys.exit({e.code!r})" + (
            "; a factory must return (model, batch, loss_fn)" if field == "module" else "")) from None
    except (KeyboardInterrupt, Exception):  # Ctrl-C is the user's; an error is read by the caller, which names it
        raise
    except BaseException as e:  # any other BaseException the user's code raises
        raise ConfigError(field, f"{what} raised {type(e).__name__}: {e}") from None
    finally:
        os._exit, atexit.register = real_exit, real_register


__all__ = ["DEFAULT_SECONDS", "REAL_BYTES", "end_user_processes", "own_processes", "time_limit", "user_code"]
