"""A snapshot file read safely: a pickle loaded with no global admitted (`safe_loads`: a snapshot is plain data,
and a pickle that names a class or function is refused with `UnsafePickleError` naming it), then checked for the
parts the reader uses, with the types torch writes them in (`check_shape`: else `SnapshotError` naming the first
entry that is not)."""

from __future__ import annotations

import io
import pickle

from ...simulator.safe_io import InputError

TRACE_FILE_LIMIT = 512 << 20  # bytes of any trace file (a snapshot, a JSON trace, a gzip'd one unpacked)
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset()
KNOWN_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "oom", "snapshot"}


class SnapshotError(InputError):
    """The file is not a snapshot we can read; the message says why."""

    def __init__(self, message: str, field_name: str = "trace") -> None:
        super().__init__(field_name, message)


class UnsafePickleError(SnapshotError):
    pass


class TruncatedTraceError(SnapshotError):
    pass


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(f"refusing to load {module}.{name}: a memory snapshot holds only plain data "
                                "(dicts, lists, strings, numbers); this pickle would import code")


def safe_loads(data: bytes, field_name: str = "trace"):
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(e.message, field_name) from None
    except Exception as e:  # truncated files, garbage, too deep: say so instead of a traceback
        raise SnapshotError(f"not a readable pickle: {type(e).__name__}: {e}", field_name) from None


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _show(x) -> str:
    """`x` in a message, at a bounded cost: a container or an object is named by its type (its repr could be
    exponential: a pickle's memo can share one tuple at every level of a deep nest), a long number by its size."""
    if isinstance(x, str):
        text = repr(x[:40])
    elif isinstance(x, bool) or x is None or isinstance(x, float):
        text = repr(x)
    elif isinstance(x, int):
        text = repr(x) if abs(x) < 10 ** 30 else f"an integer of {x.bit_length()} bits"
    else:
        text = f"a {type(x).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _frame(f) -> bool:
    """A stack frame as torch writes it: the values read are strings and a line number (types checked before a
    value is turned into text: str() of a nest the pickle's memo shares at every level takes exponential time)."""
    return isinstance(f, dict) and isinstance(f.get("name", ""), str) and isinstance(f.get("filename", ""), str) \
        and is_int(f.get("line", 0))


def _u64(x) -> bool:
    """An address or a size as torch writes them (64-bit, >= 0)."""
    return is_int(x) and 0 <= x < 1 << 64


def check_shape(snapshot, device: int, field_name: str) -> list[dict]:
    """The parts of a snapshot this reader uses, with the types torch writes them in; else SnapshotError
    naming the first entry that is not (torch/cuda/memory.py `_snapshot`, c10/cuda/CUDACachingAllocator.h)."""
    def bad(where: str, what: str):
        raise SnapshotError(f"not a CUDA memory snapshot we can read: {where} {what}", field_name)

    if not isinstance(snapshot, dict) or "device_traces" not in snapshot or "segments" not in snapshot:
        bad("the top level", "must be a dict with 'segments' and 'device_traces'")
    traces, segments = snapshot["device_traces"], snapshot["segments"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        bad("'device_traces'", "must be a list (one per device) of lists of entries")
    if not isinstance(segments, list):
        bad("'segments'", "must be a list")
    if not (is_int(device) and 0 <= device < max(len(traces), 1)):
        raise SnapshotError(f"device {device!r} not in snapshot (it has {len(traces)} device traces)", field_name)
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            bad(f"segments[{i}]", "must be a dict with a list of 'blocks'")
        if not (_u64(seg.get("address")) and _u64(seg.get("total_size")) and is_int(seg.get("device", 0))
                and is_int(seg.get("stream", 0))):
            bad(f"segments[{i}]", "needs integer 'device' and 'stream', and 'address' and 'total_size' in [0, 2**64)")
        for j, b in enumerate(seg.get("blocks", [])):
            if not isinstance(b, dict) or not _u64(b.get("address")) or not _u64(b.get("size")) \
                    or not _u64(b.get("requested_size", 0)):
                bad(f"segments[{i}].blocks[{j}]", "must be a dict with integer 'address', 'size' and "
                                                  "'requested_size' in [0, 2**64)")
    entries = traces[device] if traces else []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            bad(f"device_traces[{device}][{i}]", f"must be a dict, got {type(e).__name__}")
        action = e.get("action")
        if not isinstance(action, str) or action not in KNOWN_ACTIONS:  # (a str before hashing it)
            bad(f"device_traces[{device}][{i}]", f"has unknown action {_show(action)}; allowed: "
                                                 f"{', '.join(sorted(KNOWN_ACTIONS))}")
        # torch writes an oom's free bytes as `device_free`, not an `addr` (torch/csrc/cuda/memory_snapshot.cpp)
        if action != "snapshot" and not (_u64(e.get("addr", 0 if action == "oom" else None)) and _u64(e.get("size"))):
            bad(f"device_traces[{device}][{i}] ({action})", f"needs integer 'addr' and 'size' >= 0 (and < 2**64), got "
                                                            f"addr {_show(e.get('addr'))}, size {_show(e.get('size'))}")
        if action == "oom" and not _u64(e.get("device_free", 0)):
            bad(f"device_traces[{device}][{i}] (oom)", f"has a 'device_free' that is not an integer in [0, 2**64): "
                                                       f"{_show(e.get('device_free'))}")
        if not is_int(e.get("stream", 0)):
            bad(f"device_traces[{device}][{i}]", f"has a 'stream' that is not an integer: {_show(e.get('stream'))}")
        t = e.get("time_us", 0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or not abs(t) < 2.0 ** 63:
            bad(f"device_traces[{device}][{i}]", f"has a 'time_us' that is not a finite number below 2**63: {_show(t)}")
        if not isinstance(e.get("frames", []), list) or not all(_frame(f) for f in e.get("frames", [])):
            bad(f"device_traces[{device}][{i}]", "has 'frames' that are not a list of dicts with a str 'name' and "
                                                 "'filename' and an integer 'line'")
    return entries
