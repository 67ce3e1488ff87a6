"""The disk cache of traced recordings: a repeat of a HF model with any setting that does not change the recording
reads it back instead of tracing, and imports neither torch nor transformers.

Where: $PEAKLEDGER_CACHE_DIR (the folder itself; "off" turns the cache off), else $XDG_CACHE_HOME/peakledger/traces,
else ~/.cache/peakledger/traces. `--no-cache` (CLI) and `cache_enabled(False)` (Python) turn it off for one call.

What an entry is keyed by (`Entry`): the recording's key in the per-process cache (models/traced/__init__.py `_key`:
the config as canonical JSON and its digest, the micro-batch and sequence length, the parameter and autocast dtypes,
the frozen parameters, the LoRA knobs, checkpointing on or off, train or forward-only, and the device program:
compute capability and torch rule version), and `salt`: this file's format version, Python's minor version, the
installed versions of torch and transformers (and peft under LoRA, bitsandbytes under QLoRA) read from their
package metadata without importing them, and a digest of the recording code's own source (models/traced/*.py and
models/gpu*): an edit of peakledger, or another torch, misses. Only HF configs are cached on disk: a module
factory's recording depends on whatever code its file imports, which no digest of the file sees.

The format: zlib-compressed JSON ({"format", "key", "recording"}; `encode` / `decode`, no pickle): the full key is
stored and compared, so a file name's hash can never hand over another model's recording. An entry that cannot be
read, or reads as something else (a truncated or corrupt file, another format), is ignored and rebuilt.

Safe between processes: an entry is written to a temporary file beside it and renamed into place
(simulator/safe_io.py `write_atomic`), so a reader sees a whole entry or none; two writers of one key write the
same bytes. Bounded: after a write, entries are removed oldest first (by modification time; a hit touches its
entry) until the folder holds at most $PEAKLEDGER_CACHE_MAX_BYTES (default 2 GiB). A cache folder that cannot be
written (a read-only home) only means the next run traces again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

from ..config import ConfigError
from .recording import BackwardNode, ForwardOp, Recording, Storage

FORMAT = 2  # 2: a storage's GPU rule (Storage.rule)
DIR_ENV = "PEAKLEDGER_CACHE_DIR"
MAX_ENV = "PEAKLEDGER_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
SUFFIX = ".json.z"
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("peakledger_trace_cache", default=True)


@contextlib.contextmanager
def cache_enabled(enabled: bool) -> Iterator[None]:
    """The disk cache on or off for what runs inside (`--no-cache`)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def cache_dir() -> Path | None:
    """The cache folder (module docstring), or None where it is off."""
    if not _ENABLED.get():
        return None
    given = os.environ.get(DIR_ENV)
    if given == "off":
        return None
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "peakledger" / "traces"


def max_bytes() -> int:
    text = os.environ.get(MAX_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    if not text.isdigit():
        raise ConfigError(MAX_ENV, f"{text!r} is not a number of bytes (a whole number, e.g. {DEFAULT_MAX_BYTES})")
    return int(text)


@functools.cache
def version(package: str) -> str:
    """An installed package's version, from its metadata (the package is not imported)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def _code_digest() -> str:
    """The recording code's source (module docstring)."""
    here = Path(__file__).resolve().parent
    files = sorted(here.glob("*.py")) + sorted(here.parent.glob("gpu*.py")) + sorted(here.parent.glob("gpu/*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def salt(lora: bool = False, quantize: str = "none") -> str:
    """What every entry also depends on (module docstring)."""
    libs = ["torch", "transformers"] + (["peft"] if lora else []) + (["bitsandbytes"] if quantize != "none" else [])
    versions = ", ".join(f"{p} {version(p)}" for p in libs)
    return f"format {FORMAT}; python {sys.version_info[0]}.{sys.version_info[1]}; {versions}; code {_code_digest()}"


# -- the format ----------------------------------------------------------------------------------------------------

def _storage(s: Storage) -> list:
    return [s.id, s.nbytes, s.dtype, list(s.shape), s.name, s.born, s.op, s.requires_grad,
            None if s.death is None else list(s.death), None if s.rule is None else list(s.rule)]


def _storage_of(v: list) -> Storage:
    i, nbytes, dtype, shape, name, born, op, rg, death, rule = v
    return Storage(id=i, nbytes=nbytes, dtype=dtype, shape=tuple(shape), name=name, born=born, op=op,
                   requires_grad=rg, death=None if death is None else (death[0], death[1]),
                   rule=None if rule is None else tuple(rule))


def encode(rec: Recording) -> dict:
    """A recording as JSON-able data (`decode` gives it back equal, field for field)."""
    return {"params": [[n, list(shape), dt, rg] for n, shape, dt, rg in rec.params],
            "storages": [_storage(s) for s in rec.storages.values()],
            "buffers": [_storage(s) for s in rec.buffers], "inputs": [_storage(s) for s in rec.inputs],
            "ops": [[o.name, o.aten, o.module, list(o.reads), list(o.params), list(o.outputs), o.flops]
                    for o in rec.ops],
            "nodes": [[n.name, n.op, [list(e) for e in n.events], list(n.saves), n.flops] for n in rec.nodes],
            "param_grads": [[k, v] for k, v in rec.param_grads.items()], "held": list(rec.held),
            "modules": list(rec.modules), "layers": list(rec.layers), "model_class": rec.model_class,
            "autocast_cached": list(rec.autocast_cached)}


def decode(d: dict) -> Recording:
    storages = {s.id: s for s in map(_storage_of, d["storages"])}

    def shared(v: list) -> Storage:  # the same object as in `storages`, as the trace hands them out
        s = _storage_of(v)
        return storages[s.id] if storages.get(s.id) == s else s

    return Recording(
        params=[(n, tuple(shape), dt, rg) for n, shape, dt, rg in d["params"]],
        buffers=[shared(v) for v in d["buffers"]], inputs=[shared(v) for v in d["inputs"]], storages=storages,
        ops=[ForwardOp(name=n, aten=a, module=m, reads=tuple(r), params=tuple(p), outputs=tuple(o), flops=f)
             for n, a, m, r, p, o, f in d["ops"]],
        nodes=[BackwardNode(name=n, op=op, events=[(k, i) for k, i in ev], saves=list(sv), flops=f)
               for n, op, ev, sv, f in d["nodes"]],
        param_grads={k: v for k, v in d["param_grads"]}, held=list(d["held"]), modules=list(d["modules"]),
        layers=tuple(d["layers"]), model_class=d["model_class"], autocast_cached=tuple(d["autocast_cached"]))


# -- entries -------------------------------------------------------------------------------------------------------

def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class Entry:
    """One recording's place in the cache: `family` (the key without the micro-batch) names the file's prefix, so
    the traced micro-batch sizes of one program are found together (scale.py derives the others from them)."""

    def __init__(self, folder: Path, key: tuple, batch_slot: int, salt_text: str) -> None:
        self.folder = folder
        family = key[:batch_slot] + (None,) + key[batch_slot + 1:]
        self.family_text = f"{salt_text}\n{family!r}"
        self.prefix = f"rec-{_hash(self.family_text)}-"
        self.batch = key[batch_slot]
        self.path = self._path(self.batch)

    def _path(self, batch: int | None) -> Path:
        return self.folder / f"{self.prefix}{batch if batch is not None else 'x'}{SUFFIX}"

    def _key_text(self, batch: int | None) -> str:
        return f"{self.family_text}\nmicro_batch {batch!r}"

    def load(self) -> Recording | None:
        return _read(self.path, self._key_text(self.batch))

    def save(self, rec: Recording) -> None:
        _write(self.folder, self.path, self._key_text(self.batch), encode(rec))

    def sizes(self) -> list[int]:
        """The micro-batch sizes of this family on disk (names only, nothing read)."""
        try:
            names = [n for n in os.listdir(self.folder) if n.startswith(self.prefix) and n.endswith(SUFFIX)]
        except OSError:
            return []
        return sorted(int(b) for b in (n[len(self.prefix):-len(SUFFIX)] for n in names) if b.isdigit())

    def points(self) -> dict[int, Recording]:
        """The recordings of this family at the other micro-batch sizes on disk, read back ({} if none)."""
        found = {b: _read(self._path(b), self._key_text(b)) for b in self.sizes() if b != self.batch}
        return {b: rec for b, rec in found.items() if rec is not None}


def _read(path: Path, key_text: str) -> Recording | None:
    """The entry at `path` if it is whole and of `key_text`, else None (then it is rebuilt)."""
    try:
        data = json.loads(zlib.decompress(path.read_bytes()))
        if data.get("format") != FORMAT or data.get("key") != key_text:
            return None
        rec = decode(data["recording"])
    except FileNotFoundError:
        return None
    except Exception:  # a truncated, corrupt or foreign file: ignored, and replaced by the trace
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # the least recently used go first
    return rec


def _write(folder: Path, path: Path, key_text: str, payload) -> None:
    from ...simulator.safe_io import InputError, write_atomic

    data = zlib.compress(json.dumps({"format": FORMAT, "key": key_text, "recording": payload},
                                    separators=(",", ":")).encode(), 6)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(str(path), data, staged=False)  # (a cache: not one of the command's outputs)
    except (OSError, InputError):  # a read-only or full disk: traced again next time
        return
    evict(folder, max_bytes())


def evict(folder: Path, limit: int) -> None:
    """Remove the least recently used entries until the folder's entries hold at most `limit` bytes."""
    entries = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    entries.append((st.st_mtime_ns, e.name, st.st_size))
    except OSError:
        return
    total = sum(size for _, _, size in entries)
    for _, name, size in sorted(entries):
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            os.unlink(folder / name)
        total -= size


def entry(model, key: tuple, lora_r: int, quantize: str, batch_slot: int = 3) -> Entry | None:
    """The disk entry of a recording (key: models/traced/__init__.py `_key`), or None: not cached on disk (the cache
    is off, or the model is not a HF config)."""
    folder = cache_dir()
    if folder is None or model.kind != "hf":
        return None
    max_bytes()  # a bad $PEAKLEDGER_CACHE_MAX_BYTES is said before any work
    return Entry(folder, key, batch_slot, salt(bool(lora_r), quantize))


# -- HF task names: what transformers builds for a config, known without importing it ------------------------------

def _task_path(folder: Path, digest: str, salt_text: str) -> Path:
    return folder / f"task-{_hash(salt_text + digest)}{SUFFIX}"


def known_task(digest: str) -> tuple[str, str] | None:
    """(model class name, auto class) of a HF config (its digest) that transformers took before, or None."""
    folder = cache_dir()
    if folder is None:
        return None
    salt_text = salt()
    try:
        data = json.loads(zlib.decompress(_task_path(folder, digest, salt_text).read_bytes()))
        if data.get("format") != FORMAT or data.get("key") != f"{salt_text}\n{digest}":
            return None
        name, task = data["recording"]
        return (name, task) if isinstance(name, str) and isinstance(task, str) else None
    except Exception:  # none, or not whole: asked of transformers again
        return None


def remember_task(digest: str, class_name: str, task: str) -> None:
    folder = cache_dir()
    if folder is None:
        return
    salt_text = salt()
    _write(folder, _task_path(folder, digest, salt_text), f"{salt_text}\n{digest}", [class_name, task])


__all__ = ["cache_enabled", "cache_dir", "entry", "encode", "decode", "evict", "known_task", "remember_task", "salt"]
