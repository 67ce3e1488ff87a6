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
  `torch.from_numpy`, a tensor made at import) and is refused, naming it and what it took.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading

from ..config import ConfigError

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
def user_code(what: str, seconds: float | None = None, real_bytes: int = 0):
    """Run the block as the user's code `what` (a phrase: "importing x.py", "factory(micro_batch=2)"), for at most
    `seconds` (default: the process's limit), taking at most `real_bytes` of real memory (0: not measured)."""
    seconds = _limit[0] if seconds is None else seconds
    before = _rss() if real_bytes else (0, 0)
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
        after = _rss() if real_bytes else (0, 0)  # what it keeps, or what it took at most on the way
        grown = max(after[0] - before[0], after[1] - before[1])
        if grown > real_bytes:
            raise ConfigError("module", f"{what} took {grown / 2**30:.2f} GiB of real memory: it made real tensors "
                                        "outside peakledger's fake mode (a numpy array, torch.from_numpy, a tensor "
                                        "made at import); make them inside the factory with torch ops")
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
    except BaseException as e:  # any other BaseException the user's code raises
        raise ConfigError("module", f"{what} raised {type(e).__name__}: {e}") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        os._exit = real_exit


__all__ = ["DEFAULT_SECONDS", "REAL_BYTES", "time_limit", "user_code"]
