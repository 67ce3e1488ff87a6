"""`peakledger serve`: a process that has imported torch, transformers and peakledger once and forks a copy of
itself for each command (the zygote pattern: `serve` returns the request in the fork, and the `peakledger`
command runs it there as it would in a process of its own).

    peakledger serve --background      # start it; `peakledger ...` commands then run on it
    peakledger serve --status | --stop
    peakledger serve                   # in the foreground (Ctrl-C ends it)

Why: a command that traces a HF model spends most of its time importing torch and transformers (3-4 s of a cold
call's 4-5 s on two cores); a fork has them already. Each command is its own process still: its own working
folder, environment, streams, exit status and signals, nothing left from another command (the per-process caches
of traces start empty in each fork; the disk cache, models/traced/store.py, is shared as between processes).

When the server does not run a command (the client runs it itself, as without a server): the request comes from
another interpreter or checkout (a socket per installation makes that rare), or its environment differs from the
server's in what torch, transformers or Python read at import (protocol.IMPORT_TIME_ENV), or a source file of
peakledger that the server imported, or the installed torch, transformers, peft, bitsandbytes or torchao, changed
since it started: then it refuses, stops taking commands, and once the commands it runs have ended starts again
(exec: the same pid, arguments and environment) on what is installed now.

The server ends after `--idle` seconds without a command, on SIGTERM / SIGINT (`--stop`; the commands it runs go on
and their exit statuses are still sent), or when stale (above). One server per installation: a lock held for its
life (`<installation>.lock`, which holds its pid).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import importlib.metadata
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..models.traced import processes
from .protocol import IMPORT_TIME_ENV, NoFolder, Request, ServerError, address, interpreter, recv_request, reply

WATCHED_DISTRIBUTIONS = ("torch", "transformers", "peft", "bitsandbytes", "torchao")
START_TIMEOUT_S = 300.0  # --background: how long to wait for the server to take commands
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Snapshot:
    """What the server's imports were made of: each imported peakledger module's file (mtime, size) and the
    installed versions of the libraries a command imports."""

    files: tuple[tuple[str, int, int], ...]
    versions: tuple[tuple[str, str | None], ...]

    @classmethod
    def take(cls) -> Snapshot:
        files = []
        for name, module in sorted(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if (name == "peakledger" or name.startswith("peakledger.")) and path:
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    files.append((path, st.st_mtime_ns, st.st_size))
        return cls(tuple(files), tuple((d, _version(d)) for d in WATCHED_DISTRIBUTIONS))

    def changed(self) -> str | None:
        """What changed since the snapshot was taken (a sentence), or None."""
        for path, mtime, size in self.files:
            try:
                st = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (st.st_mtime_ns, st.st_size) != (mtime, size):
                return f"{path} changed"
        for dist, version in self.versions:
            now = _version(dist)
            if now != version:
                return f"{dist} {version or 'absent'} is now {now or 'absent'}"
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def preload(what: str) -> list[str]:
    """Import what `--preload` names (protocol.add_arguments); the modules imported, in order."""
    if what == "none":
        return []
    from ..models.catalog import CATALOG

    if what == "default":
        types = []
        for model in CATALOG:
            with contextlib.suppress(OSError, ValueError):
                types.append(json.loads(model.path.read_text()).get("model_type"))
    else:
        types = [t.strip() for t in what.split(",") if t.strip()]
    names = ["torch", "transformers", "transformers.modeling_utils", "peakledger.models.traced.recorder",
             "peakledger.models.traced.convert", "peakledger.models.traced.depth", "peakledger.models.traced.scale",
             "peakledger.models.traced.realpath", "peakledger.models.traced.real_branches", "torch.utils.flop_counter",
             "multiprocessing.popen_fork"]
    names += [f"transformers.models.{t}.modeling_{t}" for t in dict.fromkeys(types) if isinstance(t, str)]
    done = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if not name.startswith("transformers.models."):
                raise ServerError(f"--preload: cannot import {name}: {e}") from None
            if what not in ("default", "none"):
                raise ServerError(f"--preload: transformers has no model type {name.split('.')[2]!r}") from None
            continue
        done.append(name)
    return done


def _lock_path(socket_path: str) -> str:
    return socket_path.removesuffix(".sock") + ".lock"


def _holder(socket_path: str) -> int | None:
    """The pid of the server holding this installation's lock, or None where none does."""
    try:
        fd = os.open(_lock_path(socket_path), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held: a server is up
            with contextlib.suppress(ValueError):
                return int(os.read(fd, 32) or b"0") or None
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class Server:
    """The loop: accept a request, fork, reap; in the fork, `run` returns the request."""

    def __init__(self, path: str, idle: float, snapshot: Snapshot, log, lock: int, before: dict[str, str],
                 sys_path: list[str]) -> None:
        """`before`, `sys_path`: the environment and sys.path before the imports (what a request's are compared
        with)."""
        self.path, self.idle, self.snapshot, self.log, self.lock = path, idle, snapshot, log, lock
        self.sys_path = sys_path
        self.pid = os.getpid()
        self.children: dict[int, socket.socket] = {}
        self.accepting = True
        self.last = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wake_r, self.wake_w = socket.socketpair()
        self.env = {k: v for k, v in before.items() if k.startswith(IMPORT_TIME_ENV)}
        # what the imports set in the environment (torch's inductor sets TORCHINDUCTOR_CACHE_DIR when transformers
        # imports it): set again over each request's environment, as the imports would have in the client's process
        self.imports_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
        self.imports_unset = [k for k in before if k not in os.environ]
        self.uid = os.getuid()
        self.stale = False

    def refusal(self, request: Request) -> str | None:
        if request.executable != interpreter() or request.path[1:] != self.sys_path[1:]:
            return f"it runs {interpreter()} on another sys.path, not {request.executable}"
        env = {k: v for k, v in request.env.items() if k.startswith(IMPORT_TIME_ENV)}
        if env != self.env:
            differ = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k))
            return f"the environment differs from the server's in what is read at import: {', '.join(differ)}"
        stale = self.snapshot.changed()
        if stale is not None:
            self.stale = True
            self.stop(f"stale: {stale}")
            return f"it is stale ({stale}) and starts again on what is installed now"
        return None

    def stop(self, why: str) -> None:
        if self.accepting:
            self.accepting = False
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.log(f"stops taking commands: {why}")

    def serve(self) -> Request | None:
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)
        self.log(f"serving at {self.path} (pid {os.getpid()}; ends after {self.idle:g} s idle)")
        try:
            while self.accepting or self.children:
                timeout = max(0.0, self.idle - (time.monotonic() - self.last)) if not self.children else None
                watched = [self.wake_r] + ([self.listener] if self.accepting else [])
                ready, _, _ = select.select(watched, [], [], timeout)
                with contextlib.suppress(OSError):
                    while self.wake_r.recv(4096):
                        pass
                self._reap()
                if self.listener in ready and self.accepting:
                    request = self._accept()
                    if request is not None:  # in the fork
                        return request
                elif not self.children and self.accepting and time.monotonic() - self.last >= self.idle:
                    self.stop(f"idle for {self.idle:g} s")
        finally:
            if os.getpid() == self.pid:
                self.stop("ended")
                self.log("ended")
        return None

    def _on_stop(self, signum, frame) -> None:
        """SIGTERM, SIGINT, SIGHUP: take no more commands, end when those running have (the wakeup descriptor
        wakes the loop). A second one: end now (the commands go on; their exit statuses are lost)."""
        if not self.accepting:
            os._exit(128 + signum)
        self.stop(signal.Signals(signum).name)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    reply(conn, exit=code if code >= 0 else 128 - code)
                conn.close()
            self.last = time.monotonic()

    def _accept(self) -> Request | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        self.last = time.monotonic()
        fds: list[int] = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != self.uid:
                conn.close()
                return None
            conn.settimeout(10.0)
            request, fds = recv_request(conn)
            conn.settimeout(None)
            why = self.refusal(request)
            if why is not None:
                reply(conn, refused=why)
                raise ConnectionAbortedError
        except (OSError, ValueError, TypeError, ConnectionError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            try:
                self._become(request, fds, conn)
            except BaseException:
                os._exit(3)
            return request
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        with contextlib.suppress(OSError):
            reply(conn, pid=pid)
        return None

    def _become(self, request: Request, fds: list[int], conn: socket.socket) -> None:
        """In the fork: this process is the command's own, as the client would have run it."""
        signal.set_wakeup_fd(-1)
        for s in (self.listener, self.wake_r, self.wake_w, conn, *self.children.values()):
            s.close()
        os.close(self.lock)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request.cwd)
        os.umask(request.umask)
        os.environ.clear()
        os.environ.update(request.env)
        os.environ.update(self.imports_set)
        for name in self.imports_unset:
            os.environ.pop(name, None)
        sys.argv = ["peakledger", *request.argv]
        sys.path[:] = request.path
        _streams(request.encodings)
        processes.adopt()


def _streams(encodings: list[list[str | None]]) -> None:
    """sys.stdin, stdout and stderr over descriptors 0-2 with the client's encodings, buffered as Python would
    buffer them (a terminal's stdout by lines; stderr always by lines)."""
    (ein, rin), (eout, rout), (eerr, rerr) = encodings
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=ein, errors=rin)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding=eout, errors=rout, line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   encoding=eerr, errors=rerr, line_buffering=True)


def _log_to(stream):
    def log(message: str) -> None:
        print(f"peakledger serve: {message}", file=stream, flush=True)
    return log


def _none_up(detail: str) -> None:
    print(f"no server is up for this installation ({detail})")


def status(path: str) -> int:
    pid = _holder(path)
    if pid is None:
        _none_up(f"its socket would be {path}")
        return 1
    print(f"a server is up: pid {pid}, socket {path}")
    return 0


def stop(path: str) -> int:
    pid = _holder(path)
    if pid is None:
        _none_up(f"its socket would be {path}")
        return 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _holder(path) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    if _holder(path) is not None:
        print(f"peakledger: error: the server (pid {pid}) still runs commands after {STOP_TIMEOUT_S:g} s; it ends "
              "when they do", file=sys.stderr)
        return 1
    print(f"stopped the server (pid {pid})")
    return 0


def background(argv: list[str], path: str) -> int:
    """Start `peakledger serve ARGV` detached (its own session, its log beside its socket); return once it
    answers."""
    if (pid := _holder(path)) is not None:
        print(f"a server is already up: pid {pid}, socket {path}")
        return 0
    log = path.removesuffix(".sock") + ".log"
    with open(log, "ab") as out, open(os.devnull, "rb") as null:
        child = subprocess.Popen([sys.executable, "-m", "peakledger.launch", "serve", *argv], stdin=null,
                                 stdout=out, stderr=out, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = Path(log).read_text(errors="replace").splitlines()[-5:]
            print(f"peakledger: error: the server did not start (exit {child.returncode}); its log {log}:\n"
                  + "\n".join(tail), file=sys.stderr)
            return 2
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            time.sleep(0.05)
            continue
        finally:
            probe.close()
        print(f"a server is up: pid {child.pid}, socket {path}, log {log}")
        return 0
    print(f"peakledger: error: the server did not take commands within {START_TIMEOUT_S:g} s (log {log})",
          file=sys.stderr)
    return 2


def serve(options, argv: list[str]) -> int | Request:
    """`peakledger serve`, its flags parsed (`options`; `argv` as given: what the server is started with, less
    --background, in the background or again when stale): an exit status, or, in a fork made for a command, that
    command's request."""
    if not options.idle > 0:
        print(f"peakledger: error: argument --idle: {options.idle:g} is not a positive number of seconds",
              file=sys.stderr)
        return 2
    try:
        if options.status or options.stop:  # (neither makes the folder)
            try:
                path = address(os.environ)
            except NoFolder as e:
                _none_up(str(e))
                return 1 if options.status else 0
            return status(path) if options.status else stop(path)
        path = address(os.environ, create=True)
        argv = [a for a in argv if a != "--background"]
        return background(argv, path) if options.background else _foreground(path, options, argv)
    except ServerError as e:
        print(f"peakledger: error: {e}", file=sys.stderr)
        return 2


def _foreground(path: str, options, argv: list[str]) -> int | Request:
    lock = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(lock)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ServerError(f"a server is already up for this installation (pid {_holder(path)}, socket "
                              f"{path})") from None
        raise
    log = _log_to(sys.stderr)
    request = None
    try:
        os.ftruncate(lock, 0)
        os.write(lock, str(os.getpid()).encode())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by a server that was killed: the lock says none is up
        for fd in (0, 1, 2):  # open (on /dev/null where closed), so that no request's descriptor lands on them
            try:
                os.fstat(fd)
            except OSError:
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
        t0, before, sys_path = time.perf_counter(), dict(os.environ), list(sys.path)
        done = preload(options.preload)
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if alive:
            raise ServerError(f"the imports started threads ({', '.join(alive)}): a fork of this process would "
                              "not hold them")
        log(f"imported {len(done)} modules in {time.perf_counter() - t0:.1f} s")
        server = Server(path, options.idle, Snapshot.take(), log, lock, before, sys_path)
        request = server.serve()
    finally:
        if request is None:  # the server (in a fork the lock is closed already)
            os.close(lock)
    if request is None and server.stale:  # the same process again, on the code installed now, as it was started
        log("starting again on what is installed now")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "peakledger.launch", "serve", *argv], before)
    return 0 if request is None else request


__all__ = ["serve", "Server", "Snapshot", "preload"]
