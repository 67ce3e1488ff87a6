"""Output files are written atomically: a temporary file beside the target, then a rename, so a
reader never sees half a file and a crash never leaves one. Mode 0644, like a plain `open(..., "w")`."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
