"""The processes a user's code starts (`boundary.user_code`), and their end.

Which processes are the user's: every process started while a `user_code` block runs, and every process those
start in turn, whenever and however (a `subprocess.Popen`, a `multiprocessing.Process`, a daemon forked twice that
called `setsid` and was reparented to init, a helper's own children started after the block). While a block runs
this process carries a tag, a soft limit on RLIMIT_LOCKS (a resource limit the kernel keeps and copies into every
child through fork, exec and setsid, and has not enforced since Linux 2.4.25) of `TAG_BASE` + the pid of the process
that imported this module; outside the blocks its own limit is back. So the user's processes carry the tag, and
peakledger's own processes (its compile fork, the sweep's worker pools, the real distributed runs, started outside
the blocks) do not. Where peakledger's own code runs inside a block (a hook the user's code calls back, as a
compile's GEMM probe), it starts its processes under `own_processes()`, which lifts the tag meanwhile. (Not
PR_SET_CHILD_SUBREAPER: the tag finds a daemon wherever it was reparented, and a subreaper would have to reap every
orphan of its tree, which Python does not: zombies in a long-lived process, a test runner.)

When they are ended: at the end of the command (the CLI calls `end_user_processes()` when a command ends; it is an
atexit handler too, for a process where no command ends, as a spawned sweep worker; each block registers it again,
so that it runs before the atexit handlers the user's code registered), not at the end of each block: a factory may
start a helper that its model's forward, a later block of the same command, still uses, and a module's import (done
once per process) one that its factory uses.

How they are found and ended: /proc is read (each process's state, parent and start time; the tag read with
prlimit), and every process carrying the tag, or descending from one that does, and started after the tagging
process (the command's process; a fork of it, as a sweep's pool worker, shares its tag) is sent SIGTERM, then
SIGKILL once `GRACE_S` has passed, /proc read again each round so that what they start meanwhile ends too.
A pid is never mistaken for another process that took it over: the start time a process had when it was found is
read again after a pidfd was opened on it (the pidfd then names that process, whatever happens to the pid), and
the signal goes through the pidfd (where the kernel has none, Linux < 5.3: os.kill right after that check); a
process left by an earlier process that had this one's pid started before this one, and is never taken for its.
Ended processes that were this process's own children are left to their owners to reap (the user's Popen or
multiprocessing objects do it): a zombie is no longer running.

A process forked inside a block gets Python's default SIGTERM back (`_forked`, run by os.register_at_fork), as it
would have in the user's own program. Processes are ended only by the tagging process: a fork of it (a pool worker,
a process the user's code forked) ends nothing, so that it never ends the processes the command still uses.
Elsewhere than Linux (no /proc, no prlimit) all this is a no-op, as it is where the tag cannot be set (a hard
RLIMIT_LOCKS below it).

Not followed: processes started through one that is not a descendant (a systemd unit, a container, a job queue);
processes a thread the user's code left running starts after the blocks (untagged then); what is left when
peakledger itself is killed (SIGKILL: no code runs); and a separately started peakledger process (a dask or ray
worker, a torch.multiprocessing "spawn" rank) tags with its own pid: its user code's processes end when it calls
`end_user_processes` or exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

GRACE_S = 1.0  # after SIGTERM, the time a user's process has to end before SIGKILL
KILL_S = 2.0  # after the grace, the time spent sending SIGKILL to what is still there (then given up)
POLL_S = 0.02
TAG_BASE = 0x7065616B << 32  # "peak": far above any limit set by hand; + the tagging process's pid
_LOCKS = getattr(resource, "RLIMIT_LOCKS", 10)  # Linux: 10 (include/uapi/asm-generic/resource.h)


@dataclass(frozen=True)
class Tagger:
    """The process that tags its user code's processes (the one that imported this module; its forks share it)."""

    pid: int
    start: int  # its start time, clock ticks since boot (/proc/PID/stat field 22)
    tag: int  # the soft RLIMIT_LOCKS its user code's processes carry
    outside: int  # this process's own soft RLIMIT_LOCKS, outside the blocks


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of process `pid` from /proc/PID/stat, or None where gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the name, which may hold anything
        return fields[0].decode(), int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _tagger() -> Tagger | None:
    if not sys.platform.startswith("linux"):
        return None
    me = _stat(os.getpid())
    try:
        soft, hard = resource.getrlimit(_LOCKS)
    except (ValueError, OSError):
        return None
    tag = TAG_BASE + os.getpid()
    if me is None or (hard != resource.RLIM_INFINITY and hard < tag):
        return None
    return Tagger(os.getpid(), me[2], tag, soft)


_TAGGER = _tagger()  # this process's tagging (inherited by its forks); None where processes are not followed


def _forked() -> None:
    """In a process forked inside a block (the user's: peakledger forks none there), SIGTERM is Python's default
    again: the handler peakledger's CLI set would raise into the fork's copy of peakledger's stack, and the process
    would end printing a traceback that names peakledger when it is ended."""
    t = _TAGGER
    if t is None or resource.getrlimit(_LOCKS)[0] != t.tag:
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def adopt() -> None:
    """From now on this process tags its user code's processes, not the one it was forked from: a fork that runs a
    command as a process of its own (peakledger serve's; its forks share its tag as any command's do)."""
    global _TAGGER
    _TAGGER = _tagger()


if _TAGGER is not None:
    os.register_at_fork(after_in_child=_forked)
_atexit_register, _atexit_unregister = atexit.register, atexit.unregister  # atexit's own (user_code replaces one)


def _set_soft(value: int) -> None:
    """Set this process's soft RLIMIT_LOCKS (at most the hard limit, which the user's code may have lowered)."""
    hard = resource.getrlimit(_LOCKS)[1]
    if hard != resource.RLIM_INFINITY and (value == resource.RLIM_INFINITY or value > hard):
        value = hard
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(_LOCKS, (value, hard))


@contextlib.contextmanager
def tagged() -> Iterator[None]:
    """Within the block, the processes this one starts are the user's (module docstring). At its end, in the
    tagging process, `end_user_processes` is (again) the last atexit handler registered: the first to run."""
    t = _TAGGER
    if t is None:
        yield
        return
    previous = resource.getrlimit(_LOCKS)[0]
    _set_soft(t.tag)
    try:
        yield
    finally:
        _set_soft(previous)
        if os.getpid() == t.pid:
            _atexit_unregister(end_user_processes)
            _atexit_register(end_user_processes)


@contextlib.contextmanager
def own_processes() -> Iterator[None]:
    """peakledger's own code run inside a `user_code` block (a hook the user's code calls back): the processes it
    starts within are peakledger's, never ended by `end_user_processes`."""
    t = _TAGGER
    now = resource.getrlimit(_LOCKS)[0] if t is not None else None
    if t is None or now != t.tag:
        yield
        return
    _set_soft(t.outside)
    try:
        yield
    finally:
        _set_soft(now)


def _carries(pid: int, tag: int) -> bool:
    try:
        return resource.prlimit(pid, _LOCKS)[0] == tag
    except (ValueError, OSError):  # gone, or another user's
        return False


def user_processes() -> set[tuple[int, int]]:
    """(pid, start time) of each running process of the user's code (module docstring): tagged, or descending from
    a tagged one, started after the tagging process; never this one."""
    t = _TAGGER
    if t is None:
        return set()
    me = os.getpid()
    table: dict[int, tuple[int, int]] = {}  # pid -> (parent, start)
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            st = _stat(int(name))
            if st is not None and st[0] not in "ZX" and st[2] >= t.start:  # older ones cannot be the user's
                table[int(name)] = st[1], st[2]
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {pid for pid in table if _carries(pid, t.tag)}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {(pid, table[pid][1]) for pid in found}


def _alive(ident: tuple[int, int]) -> bool:
    st = _stat(ident[0])
    return st is not None and st[2] == ident[1] and st[0] not in "ZX"


def _send(ident: tuple[int, int], sig: int) -> bool:
    """Send `sig` to the process (pid, start time), never to another that took its pid (module docstring)."""
    pid, start = ident
    try:
        fd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone (then the check below says so), or no pidfd on this kernel
        fd = None
    try:
        st = _stat(pid)
        if st is None or st[2] != start:
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def end_user_processes(grace: float = GRACE_S) -> int:
    """End the processes the user's code started (module docstring): SIGTERM, and SIGKILL to those still running
    after `grace` seconds. Returns how many were signalled. Called when a command ends, and at exit; a no-op in a
    fork of the tagging process and elsewhere than Linux."""
    t = _TAGGER
    if t is None or os.getpid() != t.pid:
        return 0
    sent: dict[tuple[int, int], int] = {}
    term_until = time.monotonic() + grace
    found = user_processes()
    while found and time.monotonic() < term_until + KILL_S:
        sig = signal.SIGTERM if time.monotonic() < term_until else signal.SIGKILL
        for ident in found:
            if sent.get(ident) != sig and _send(ident, sig):
                sent[ident] = sig
        wait_until = term_until if sig == signal.SIGTERM else time.monotonic() + 10 * POLL_S
        while any(_alive(ident) for ident in found) and time.monotonic() < wait_until:
            time.sleep(POLL_S)
        found = user_processes()
    return len(sent)


if _TAGGER is not None:  # at exit too: where no command's end came (a worker started as a process of its own)
    _atexit_register(end_user_processes)


__all__ = ["GRACE_S", "TAG_BASE", "Tagger", "adopt", "end_user_processes", "own_processes", "tagged", "user_processes"]
