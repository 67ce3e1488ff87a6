"""The `peakledger` command's side: hand the command to this installation's server where one is up, else say so
(`None`) and let the caller run it in its own process. Imports nothing of peakledger's beyond protocol.py, so a
command the server runs costs the client a Python start and a socket."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

from .protocol import MODE_ENV, Request, ServerError, address, interpreter, mode, send_request

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _encodings() -> list[list[str | None]]:
    return [[getattr(s, "encoding", None), getattr(s, "errors", None)] for s in (sys.stdin, sys.stdout, sys.stderr)]


def _refused(why: str, required: bool) -> int | None:
    """Where the server does not run the command: under require, exit 2 naming why; else run it here."""
    if not required:
        return None
    print(f"peakledger: error: {MODE_ENV}=require, and {why}", file=sys.stderr)
    return 2


def forward(argv: list[str]) -> int | None:
    """Run `argv` on the server: its exit status, or None where no server runs it (this process should)."""
    try:
        wanted = mode(os.environ)
    except ServerError as e:
        print(f"peakledger: error: {e}", file=sys.stderr)
        return 2
    if wanted == "off":
        return None
    required = wanted == "require"
    try:
        path = address(os.environ)
        for fd in (0, 1, 2):
            os.fstat(fd)
    except ServerError as e:
        return _refused(str(e), required)
    except OSError:
        return _refused("this process has no stdin, stdout or stderr to hand over", required)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(path)
        except OSError:
            return _refused(f"no server is up at {path} (peakledger serve --background starts one)", required)
        umask = os.umask(0)
        os.umask(umask)
        request = Request(argv=list(argv), cwd=os.getcwd(), umask=umask, env=dict(os.environ),
                          executable=interpreter(), path=list(sys.path), encodings=_encodings())
        try:
            send_request(sock, request, [0, 1, 2])
        except OSError as e:
            return _refused(f"the server at {path} did not take the command ({e.strerror or e})", required)
        return _outcome(sock.makefile("rb"), path, required)
    finally:
        sock.close()


def _outcome(replies, path: str, required: bool) -> int | None:
    """Read the server's replies: the command's exit status, forwarding this process's signals to it meanwhile."""
    previous: dict[int, object] = {}
    try:
        for line in replies:
            message = json.loads(line)
            if "refused" in message:
                return _refused(f"the server at {path} refused: {message['refused']}", required)
            if "pid" in message:
                pid = message["pid"]

                def pass_on(signum, frame, pid=pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signum)

                for sig in FORWARDED:
                    previous[sig] = signal.signal(sig, pass_on)
            if "exit" in message:
                return int(message["exit"])
    except (OSError, ValueError):
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not previous:  # nothing ran: this process runs it
        return _refused(f"the server at {path} ended before it ran the command", required)
    print(f"peakledger: error: the server at {path} ended while it ran the command; its outputs may be missing",
          file=sys.stderr)
    return 3


__all__ = ["forward"]
