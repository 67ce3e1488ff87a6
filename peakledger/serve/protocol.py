"""What a `peakledger` command and a server of its own installation say to each other, and where they meet.

Where: a Unix socket, one per installation (the interpreter, its prefix and peakledger's own folder name it, so a
server never runs another venv's or another checkout's command), in $PEAKLEDGER_SERVER_DIR, else
$XDG_RUNTIME_DIR/peakledger, else /tmp/peakledger-UID: a folder of this user's alone (mode 0700, owned by the user;
one that is not is never used), and the server takes requests only from its own user (SO_PEERCRED).

A request: an 8-byte length, sent with the client's stdin, stdout and stderr as file descriptors (SCM_RIGHTS), then
that many bytes of JSON (`Request`): the command line, the working folder, the umask, the environment, the
interpreter and its sys.path, and the encodings of the three streams. The command writes to the client's own
streams: a terminal stays a terminal, `| head` closes the pipe the command writes to.
Replies: JSON lines, {"pid": N} once the command runs (the process the client forwards its signals to), then
{"exit": status} when it ended (128 + N where a signal N ended it); or {"refused": reason} where the server does not
run it (the client then runs the command itself).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
from dataclasses import asdict, dataclass

PROTOCOL = 1
MODE_ENV = "PEAKLEDGER_SERVER"  # auto (default): use a server that is up; off: never; require: a server or exit 2
DIR_ENV = "PEAKLEDGER_SERVER_DIR"
MODES = ("auto", "off", "require")
# what torch, transformers and Python read when imported (the server imported them under its own environment): a
# request whose environment differs from the server's in any of these is refused, and runs in the client's process
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVIDIA", "HF_", "HUGGINGFACE",
                   "TRANSFORMERS", "TOKENIZERS", "LD_", "USE_", "XDG_CACHE_HOME", "MALLOC_", "GLIBC_")
_LENGTH = struct.Struct("!Q")
MAX_REQUEST = 16 << 20
MAX_PATH = 107  # sockaddr_un's sun_path, less its final NUL (Linux: 108 bytes)


class ServerError(Exception):
    """A server that cannot be used or started (its folder, its socket): the message names why."""


class NoFolder(ServerError):
    """The folder of the sockets is not there: no server has been started in it."""


@dataclass(frozen=True)
class Request:
    """One command, as the client would have run it in its own process."""

    argv: list[str]
    cwd: str
    umask: int
    env: dict[str, str]
    executable: str
    path: list[str]
    encodings: list[list[str | None]]  # stdin, stdout, stderr: [encoding, errors]
    protocol: int = PROTOCOL

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        fields = json.loads(data)
        if not isinstance(fields, dict) or fields.get("protocol") != PROTOCOL:
            raise ValueError(f"not a request of protocol {PROTOCOL}")
        return cls(**fields)


def mode(env: dict[str, str] | os._Environ) -> str:
    """$PEAKLEDGER_SERVER, checked: auto, off or require."""
    value = env.get(MODE_ENV, "auto") or "auto"
    if value not in MODES:
        raise ServerError(f"{MODE_ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def installation() -> str:
    """The digest naming this installation: the interpreter, its prefix, peakledger's own folder."""
    import hashlib  # (here: the client imports no more than it needs)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return hashlib.sha256("\0".join((interpreter(), sys.prefix, here)).encode()).hexdigest()[:16]


def interpreter() -> str:
    """This interpreter, its links resolved (a venv's bin/python and bin/python3 are one)."""
    return os.path.realpath(sys.executable)


def folder(env: dict[str, str] | os._Environ, create: bool = False) -> str:
    """The folder of this user's sockets (module docstring); ServerError where it is not this user's alone."""
    base = env.get(DIR_ENV)
    if not base:
        runtime = env.get("XDG_RUNTIME_DIR")
        base = os.path.join(runtime, "peakledger") if runtime else f"/tmp/peakledger-{os.getuid()}"
    if create:
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ServerError(f"cannot make the server's folder {base}: {e.strerror}") from None
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        raise NoFolder(f"no server folder {base}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ServerError(f"the server's folder {base} is not this user's alone (owner {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}; it must be a folder of uid {os.getuid()}, mode 700)")
    return base


def address(env: dict[str, str] | os._Environ, create: bool = False) -> str:
    """The socket of this installation's server."""
    path = os.path.join(folder(env, create), installation() + ".sock")
    if len(os.fsencode(path)) > MAX_PATH:
        raise ServerError(f"the server's socket {path} is longer than a socket's path may be ({MAX_PATH} bytes): "
                          f"set {DIR_ENV} to a shorter folder")
    return path


def send_request(sock: socket.socket, request: Request, fds: list[int]) -> None:
    data = request.encode()
    socket.send_fds(sock, [_LENGTH.pack(len(data))], fds)
    sock.sendall(data)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_request(sock: socket.socket) -> tuple[Request, list[int]]:
    """The request and the three descriptors; ValueError (the descriptors closed) where it is not one."""
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 3)
    try:
        if len(head) < _LENGTH.size:
            head += recv_exactly(sock, _LENGTH.size - len(head))
        (length,) = _LENGTH.unpack(head)
        if length > MAX_REQUEST or len(fds) != 3:
            raise ValueError(f"a request of {length} bytes and {len(fds)} descriptors")
        return Request.decode(recv_exactly(sock, length)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def reply(sock: socket.socket, **fields: object) -> None:
    sock.sendall(json.dumps(fields, sort_keys=True).encode() + b"\n")


def add_arguments(parser) -> None:
    """`peakledger serve`'s flags (its help in `peakledger --help`, its parsing in peakledger/serve/server.py)."""
    parser.add_argument("--background", action="store_true",
                        help="start the server in the background and return once it takes commands")
    parser.add_argument("--stop", action="store_true", help="stop this installation's server")
    parser.add_argument("--status", action="store_true", help="say whether a server is up, its pid and what it holds")
    parser.add_argument("--idle", type=float, default=3600.0, metavar="SECONDS",
                        help="end after this long with no command (default 3600)")
    parser.add_argument("--preload", default="default", metavar="LIST",
                        help="what the server imports before it takes commands: 'default' (torch, transformers "
                             "and the causal-LM model types of peakledger's bundled configs), 'none' (peakledger "
                             "alone), or HF model types separated by commas (torch and transformers with them)")


__all__ = ["Request", "ServerError", "NoFolder", "PROTOCOL", "MODE_ENV", "DIR_ENV", "MODES", "IMPORT_TIME_ENV", "mode",
           "installation", "interpreter", "folder", "address", "send_request", "recv_request", "recv_exactly", "reply",
           "add_arguments"]
