"""The boundary around a user's code (a `--module` file: its import, its factory, its model's forward and loss).

Whatever the code does, peakledger keeps the process and its output:
- `sys.exit(n)` / `SystemExit`, any other `BaseException` but Ctrl-C, and `os._exit(n)` (replaced while the code
  runs) become a ConfigError naming the code, exit 2;
- what it prints goes to stderr, so stdout stays the command's output (`--json` stays JSON);
- it runs for at most the limit (`time_limit`, SIGALRM, on the main thread; 0 = none): a factory that hangs in Python
  code ends with exit 2 naming it (one stuck inside a C call ends when that call returns).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from ..config import ConfigError

DEFAULT_SECONDS = 600.0
_limit = [DEFAULT_SECONDS]  # the limit now: `time_limit` (the CLI's --module-timeout), read by `user_code`


@contextlib.contextmanager
def time_limit(seconds: float | None):
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

    def __init__(self, status) -> None:
        super().__init__(status)
        self.status = status


class _TimedOut(BaseException):
    pass


@contextlib.contextmanager
def user_code(what: str, seconds: float | None = None):
    """Run the block as the user's code `what` (a phrase: "importing x.py", "factory(micro_batch=2)"), for at most
    `seconds` (default: the process's limit)."""
    seconds = _limit[0] if seconds is None else seconds
    real_exit = os._exit

    def no_exit(status=0):
        raise _Exited(status)

    def alarm(signum, frame):
        raise _TimedOut()

    timed = seconds and seconds > 0 and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, alarm) if timed else None
    os._exit = no_exit
    try:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, seconds)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except _TimedOut:
        raise ConfigError("module", f"{what} ran for more than {seconds:g} s; a factory builds a model, it does "
                                    "not train it (raise the limit with --module-timeout SECONDS)") from None
    except _Exited as e:
        raise ConfigError("module", f"{what} called os._exit({e.status}); a factory must return (model, batch, "
                                    "loss_fn)") from None
    except SystemExit as e:
        raise ConfigError("module", f"{what} called sys.exit({e.code!r}); a factory must return (model, batch, "
                                    "loss_fn)") from None
    except (KeyboardInterrupt, Exception):  # Ctrl-C is the user's; an error is read by the caller, which names it
        raise
    except BaseException as e:  # noqa: BLE001 - any other BaseException the user's code raises
        raise ConfigError("module", f"{what} raised {type(e).__name__}: {e}") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        os._exit = real_exit


__all__ = ["DEFAULT_SECONDS", "time_limit", "user_code"]
