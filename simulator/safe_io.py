"""Files in and out, safely: bounded reads of input files, checked and atomic writes of outputs.

Inputs (`read_input`): a regular file or a pipe, at most `limit` bytes (a device such as /dev/zero, a
directory or a file over the cap is refused before it is read), else `InputError` naming the input. A pipe
that gives nothing for `PIPE_IDLE_SECONDS` (no writer, or one that stalls) is refused instead of waited on.

Outputs are checked before any work (`check_outputs`): not empty, the parent folder exists and takes a
new file, not a folder, device, pipe or socket, never one of the command's inputs, never given twice.
They are written atomically (`write_atomic`): a temporary file beside the target, then a rename, so a
reader never sees half a file. Inside `all_or_none()` (the CLI runs every command in one) the outputs of
the command are one set: each is written to its temporary file as the command makes it, and only when the
command returns are they all renamed into place; a write that fails (a full disk) or any error removes
every temporary file, so a command leaves all its outputs or none.
A new file gets the user's umask (0666 & ~umask, as `open(..., "w")`),
a replaced file keeps its mode; a symbolic link is followed and its target replaced, not the link.
The temporary file is removed on every exit path that runs Python (errors, Ctrl-C, SIGTERM through the
CLI's handler); one left by a run killed outright (SIGKILL) is removed by the next write into the same
folder once its process is gone (its name carries the pid).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import select
import stat
import sys
import tempfile
import time
from collections.abc import Iterator

TMP_PREFIX = ".peakledger-tmp-"
PIPE_IDLE_SECONDS = 10.0  # a named pipe given as an input: the longest wait for its next bytes
PIPE_TOTAL_SECONDS = 30.0  # and for all of them: a writer that trickles a line every few seconds is cut off


class InputError(ValueError):
    """A bad input: `field` names it (a flag, a key, a file), the message says what is wrong and what is
    allowed. Every layer raises its own subclass; the CLI turns any of them into one line and exit 2."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_input(path, field_name: str, limit: int) -> bytes:
    """The bytes of input file `path` (a regular file or a pipe), refused above `limit` bytes."""
    if path is None or str(path) == "":
        raise InputError(field_name, "an empty path; give a file")
    try:
        st = os.stat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise InputError(field_name, f"{path} is {_kind(st.st_mode)}; give a file")
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise InputError(field_name, f"{path} is {st.st_size:,} B, over the {limit:,} B cap for this kind of "
                                         "input")
        if stat.S_ISFIFO(st.st_mode):
            data = _read_pipe(path, field_name, limit)
        else:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
    except FileNotFoundError:
        raise InputError(field_name, f"file not found: {path}") from None
    except OSError as e:
        raise InputError(field_name, f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise InputError(field_name, f"{path} holds more than the {limit:,} B cap for this kind of input")
    return data


def _read_pipe(path, field_name: str, limit: int) -> bytes:
    """A named pipe's bytes up to its end (at most `limit` + 1), each wait for more bounded by PIPE_IDLE_SECONDS:
    opened without blocking (an open for reading waits for a writer otherwise), read when select says so."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        chunks, size = [], 0
        end = time.monotonic() + PIPE_TOTAL_SECONDS
        while size <= limit:
            left = end - time.monotonic()
            ready = select.select([fd], [], [], min(PIPE_IDLE_SECONDS, left))[0] if left > 0 else []
            if not ready and time.monotonic() >= end:
                raise InputError(field_name, f"{path} is a named pipe still sending after {PIPE_TOTAL_SECONDS:g} s "
                                             "(the longest peakledger reads one input); write it to a file first")
            if not ready:
                raise InputError(field_name, f"{path} is a named pipe that gave no data for {PIPE_IDLE_SECONDS:g} s "
                                             "(nothing writes to it?); give a file, or start its writer first")
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            except BlockingIOError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def too_many_digits(e: BaseException) -> bool:
    """`e` is Python's refusal to read an integer of more digits than `sys.get_int_max_str_digits()`."""
    return type(e) is ValueError and "integer string conversion" in str(e)


def digits_message(where) -> str:
    """What to say of an input holding such an integer."""
    return (f"{where} holds an integer of more than {sys.get_int_max_str_digits():,} digits (Python's limit for "
            "reading one); no count or size is that long")


def read_text(path, field_name: str, limit: int) -> str:
    """`read_input` decoded as UTF-8 (a binary file is refused, naming the input)."""
    data = read_input(path, field_name, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(field_name, f"{path} is not UTF-8 text (byte {e.start}): give a text file") from None


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_outputs(outputs: dict[str, str], inputs: dict[str, str] | None = None) -> None:
    """Every output path (flag -> path) can be written, before any work: `InputError` naming the flag."""
    inputs = {k: v for k, v in (inputs or {}).items() if v}
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if str(path) == "":
            raise InputError(flag, "an empty path; give a file name")
        target = os.path.realpath(path)
        try:
            os.stat(target)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EACCES):
                raise InputError(flag, f"{path} cannot be written: {e.strerror}") from None
        if os.path.lexists(target):
            mode = os.stat(target).st_mode if os.path.exists(target) else 0
            if mode and not stat.S_ISREG(mode):
                raise InputError(flag, f"{path} is {_kind(mode)}; peakledger writes regular files only")
            if mode and not os.access(target, os.W_OK):  # (the rename would replace what open() may not write)
                raise InputError(flag, f"{path} is read-only for you: peakledger replaces only a file you could "
                                       "write; make it writable (chmod u+w) or give another path")
        parent = os.path.dirname(target) or "."
        if not os.path.isdir(parent):
            raise InputError(flag, f"folder {os.path.dirname(path) or '.'} does not exist")
        try:  # the real test of "can a new file be made there": root ignores mode bits, not read-only mounts;
            # a byte written finds a full disk (a file can be made while no block is left)
            fd, probe = tempfile.mkstemp(dir=parent, prefix=TMP_PREFIX + f"{os.getpid()}-")
            try:
                os.write(fd, b"\0")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            raise InputError(flag, f"cannot write into {parent}: {e.strerror or e}") from None
        for other, ipath in inputs.items():
            if _same(ipath, target):
                raise InputError(flag, f"{path} is the input of {other}: an output never replaces an input")
        for other_flag, other in seen.items():
            if _same(other, target) or other == target:
                raise InputError(flag, f"{path} is also the output of {other_flag}: give two different files")
        seen[flag] = target
        stage = _STAGE.get()
        if stage is not None:
            stage.names[target] = flag


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _clean_stale(directory: str) -> None:
    """Remove temporary files of writers that were killed outright (their pid no longer runs)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(TMP_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(TMP_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except OSError:
            pass


class _Stage:
    """The outputs of one command while it runs: (temporary file, target) of each written and not yet moved."""

    def __init__(self) -> None:
        self.files: list[tuple[str, str]] = []
        self.names: dict[str, str] = {}  # target -> the flag that named it (check_outputs), for messages

    def discard(self) -> None:
        for tmp, _ in self.files:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self.files.clear()

    def commit(self) -> None:
        while self.files:  # (a rename that fails leaves the rest to discard)
            os.replace(*self.files[0])
            self.files.pop(0)


_STAGE: contextvars.ContextVar[_Stage | None] = contextvars.ContextVar("peakledger_outputs", default=None)


@contextlib.contextmanager
def all_or_none() -> Iterator[None]:
    """Within the block, `write_atomic` stages each output; when the block ends normally they are all moved into
    place, when it raises none is (their temporary files are removed)."""
    stage = _Stage()
    token = _STAGE.set(stage)
    try:
        yield
        stage.commit()
    finally:
        _STAGE.reset(token)
        stage.discard()


def write_atomic(path, data: bytes, staged: bool = True) -> None:
    """Write `data` to `path` atomically (see the module docstring); inside `all_or_none()` the file is moved into
    place when the command ends (`staged=False`: at once, for a cache that is no command's output). A write
    that fails (a full disk, a file-size limit) is an InputError naming the output; nothing of it is left."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    _clean_stale(directory)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    stage = _STAGE.get() if staged else None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX + f"{os.getpid()}-")
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
        except OSError as e:
            name = stage.names.get(target, str(path)) if stage is not None else str(path)
            rest = "; nothing was written" if stage is not None else ""
            raise InputError(name, f"cannot write {path}: {e.strerror or e}{rest}") from None
        if stage is not None:
            stage.files.append((tmp, target))
            tmp = ""
        else:
            os.replace(tmp, target)
    finally:
        if tmp and os.path.lexists(tmp):
            os.unlink(tmp)


__all__ = ["InputError", "read_input", "read_text", "check_outputs", "write_atomic", "all_or_none"]
