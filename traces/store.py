"""Event logs on disk: compact, versioned JSON, for measured traces and simulated runs alike.

Layout (format "peakledger-trace", version 1):

    {"format": "peakledger-trace", "version": 1, "source": "torch-dispatch-tracker",
     "metadata": {...torch version, model config, training setup...},   (simulator/run_metadata.py)
     "blocks": [[id, nbytes, category, name, dtype, shape, state, shard_factor, rank, pool(, pinned)], ...],
     "events": [[seq, time, action, block_id, phase, step, micro_batch_index, stream, op], ...]}

A pinned host block (simulator/events.py `Block.pinned`) carries an 11th element, true; a device block outside
torch's caching allocator (`Block.outside_allocator`) an 11th element false and a 12th, true; every other block
has 10, so a log without either is written as before. Blocks are stored once and events refer to them, so
a trace is a fraction of a naive dump. Loading
checks the format and version and every reference, and raises `TraceFormatError` saying what is wrong.
The metadata is the log's `RunMetadata` (`to_json_dict` / `from_json_dict`); its training setup is read back
as a `TrainingSetup` (`read_setup`), a setup written before some knob existed with that knob's default.
Files are written atomically (temporary file, then rename), keys sorted: same log, same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..models.config import KNOBS, ConfigError, TrainingSetup
from ..simulator import strict_json
from ..simulator.events import Action, Block, Category, Event, EventLog, OptimizerState, Phase, Pool, Stream
from ..simulator.run_metadata import RunMetadata
from ..simulator.safe_io import InputError, read_input, write_atomic
from .cuda_snapshot import TRACE_FILE_LIMIT, merge_devices, parse_snapshot_devices, safe_loads

FORMAT = "peakledger-trace"
VERSION = 1


class TraceFormatError(InputError):
    """A trace file that cannot be read as one (the message says why)."""

    def __init__(self, message: str, field_name: str = "trace") -> None:
        super().__init__(field_name, message)


def to_json(log: EventLog) -> dict:
    blocks: dict[int, Block] = {}
    for e in log.events:
        blocks.setdefault(e.block.id, e.block)
    return {
        "format": FORMAT, "version": VERSION, "source": log.source, "metadata": log.metadata.to_json_dict(),
        "blocks": [[b.id, b.nbytes, b.category.value, b.name, b.dtype, list(b.shape),
                    b.state.value if b.state else None, b.shard_factor, b.rank, b.pool.value]
                   + ([True] if b.pinned else [False, True] if b.outside_allocator else [])
                   for b in blocks.values()],
        "events": [[e.seq, e.time, e.action.value, e.block.id, e.phase.value, e.step, e.micro_batch_index,
                    e.stream.value, e.op] for e in log.events],
    }


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def from_json(data: dict) -> EventLog:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceFormatError(f"not a peakledger trace (expected format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise TraceFormatError(f"trace version {data.get('version')!r} is not supported; "
                               f"this peakledger reads {VERSION}")
    if not isinstance(data.get("metadata", {}), dict) or not isinstance(data.get("source", ""), str):
        raise TraceFormatError("malformed trace: 'metadata' must be an object and 'source' a string")
    try:
        blocks = {}
        for row in data["blocks"]:
            if not isinstance(row, list) or len(row) not in (10, 11, 12) or (len(row) == 11 and row[10] is not True) \
                    or (len(row) == 12 and (row[10], row[11]) != (False, True)):
                raise TraceFormatError(f"block {row!r}: expected [id, bytes, category, name, dtype, shape, state, "
                                       "shard factor, rank, pool] and, for a pinned host block, true; for a device "
                                       "block outside the caching allocator, false, true")
            bid, nbytes, cat, name, dtype, shape, state, shard, rank, pool = row[:10]
            pinned, outside = len(row) == 11, len(row) == 12
            if not (_is_int(bid) and _is_int(nbytes) and _is_int(shard) and _is_int(rank)):
                raise TraceFormatError(f"block {bid!r}: id, bytes, shard factor and rank must be integers, got "
                                       f"{[bid, nbytes, shard, rank]!r}")
            if nbytes < 0 or shard < 1 or rank < 0:
                raise TraceFormatError(f"block {bid!r}: bytes must be >= 0, shard factor >= 1, rank >= 0; got "
                                       f"{nbytes!r}, {shard!r}, {rank!r}")
            if bid in blocks:
                raise TraceFormatError(f"block id {bid!r} is listed twice")
            if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
                    and all(_is_int(n) and n >= 0 for n in shape)):
                raise TraceFormatError(f"block {bid!r}: name and dtype must be strings and shape a list of integers "
                                       f">= 0, got {[name, dtype, shape]!r}")
            blocks[bid] = Block(id=bid, nbytes=nbytes, category=Category(cat), name=name, dtype=dtype,
                                shape=tuple(shape), state=None if state is None else OptimizerState(state),
                                shard_factor=shard, rank=rank, pool=Pool(pool), pinned=pinned,
                                outside_allocator=outside)
        events = []
        for seq, t, a, bid, ph, step, mb, st, op in data["events"]:
            if not (_is_int(seq) and _is_int(step) and _is_int(mb)) or isinstance(t, bool) \
                    or not isinstance(t, (int, float)) or t != t or t in (float("inf"), float("-inf")):
                raise TraceFormatError(f"event {seq!r}: seq, step and micro-batch must be integers and time a "
                                       f"finite number, got {[seq, t, step, mb]!r}")
            if not isinstance(op, str):
                raise TraceFormatError(f"event {seq!r}: op must be a string, got {op!r}")
            events.append(Event(seq=seq, time=float(t), action=Action(a), block=blocks[bid], phase=Phase(ph),
                                step=step, micro_batch_index=mb, stream=Stream(st), op=op))
    except KeyError as e:
        raise TraceFormatError(f"malformed trace: an event refers to unknown block {e} (or a key is missing)") from None
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, TraceFormatError):
            raise
        raise TraceFormatError(f"malformed trace: {e}") from None
    metadata = RunMetadata.from_json_dict(data.get("metadata", {}), read_setup)
    log = EventLog(events=events, source=data.get("source", "?"), metadata=metadata)
    check_consistency(log)
    return log


def read_setup(values) -> TrainingSetup:
    """The training setup a trace's metadata records (`TrainingSetup.knob_values()`), read back: keys this
    peakledger has no knob for left out, as `validate --trace` always read them; a knob the trace predates takes
    its default. One this peakledger refuses is a TraceFormatError."""
    if not isinstance(values, dict):
        raise TraceFormatError(f"malformed trace: the metadata's 'setup' must be an object, got {values!r:.80}")
    try:
        return TrainingSetup.from_knob_values({k: v for k, v in values.items() if k in KNOBS})
    except (TypeError, ConfigError) as e:
        raise TraceFormatError(f"the scenario recorded in the trace is not one this peakledger reads: {e}") from None


def check_consistency(log: EventLog) -> None:
    """A trace is a life story of blocks: it has events, and every block is allocated before it is freed,
    freed at most once, and never allocated again while live. Anything else is refused, naming the event."""
    if not log.events:
        raise TraceFormatError("the trace holds no events: nothing was recorded")
    live: set[int] = set()
    done: set[int] = set()
    for i, e in enumerate(log.events):
        bid = e.block.id
        if e.action is Action.ALLOC:
            if bid in live or bid in done:
                raise TraceFormatError(f"event {i} allocates block {bid} ({e.block.name}) a second time")
            live.add(bid)
        else:
            if bid not in live:
                raise TraceFormatError(f"event {i} frees block {bid} ({e.block.name}), which is not allocated at "
                                       "that point (a free before its alloc, or twice)")
            live.discard(bid)
            done.add(bid)


def with_event_index_times(log: EventLog) -> EventLog:
    """The same log with `time` = event index: measured wall-clock times differ run to run, and a
    stored reference trace should be byte-for-byte reproducible."""
    events = [dataclasses.replace(e, time=float(e.seq)) for e in log.events]
    return EventLog(events=events, source=log.source, metadata=log.metadata.updated(time="event index"),
                    ooms=log.ooms)


def save_log(log: EventLog, path: str | Path) -> None:
    write_atomic(path, (json.dumps(to_json(log), sort_keys=True, separators=(",", ":")) + "\n").encode())


def load_log(path: str | Path, field_name: str = "trace") -> EventLog:
    """A peakledger JSON trace file (plain or gzip'd)."""
    data = _unpacked(read_input(path, field_name, TRACE_FILE_LIMIT), path, field_name)
    return _json_log(data, path, field_name)


def _unpacked(data: bytes, path, field_name: str) -> bytes:
    """gzip'd content unpacked (told by its magic bytes), within the same cap."""
    if not data.startswith(b"\x1f\x8b"):
        return data
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(data, TRACE_FILE_LIMIT + 1)
    except zlib.error as e:
        raise TraceFormatError(f"{path} is a broken gzip file: {e}", field_name) from None
    if len(out) > TRACE_FILE_LIMIT:
        raise TraceFormatError(f"{path} unpacks to more than the {TRACE_FILE_LIMIT:,} B cap", field_name)
    if not d.eof:
        raise TraceFormatError(f"{path} is a truncated gzip file", field_name)
    return out


def _json_log(data: bytes, path, field_name: str) -> EventLog:
    try:
        obj = strict_json.loads(data.decode("utf-8"))
    except strict_json.JSONRefused as e:
        raise TraceFormatError(f"{path}: {e}", field_name) from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path} is neither JSON text nor a CUDA snapshot pickle", field_name) from None
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path} is not JSON: {e}", field_name) from None
    try:
        return from_json(obj)
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e.message}", field_name) from None


@dataclass(frozen=True)
class TraceFile:
    """A measured trace read from a file, whatever its format: the allocated-memory log, what kind of file
    it was, and whether the recording is incomplete (then every reading of it is a lower bound). A CUDA
    snapshot also gives its reserved-memory log (segments: what cudaMalloc holds), every device in one log
    each (block rank = device), both opening with the state at record start."""

    path: str
    kind: str  # "peakledger trace" or "CUDA snapshot"
    log: EventLog
    truncated: bool = False
    notes: tuple[str, ...] = ()
    reserved: EventLog | None = None  # CUDA snapshots only

    def warning(self) -> str | None:
        if not self.truncated:
            return None
        return (f"{self.path} is truncated ({'; '.join(self.notes[:2])}): what happened before its first entry is "
                "not all accounted for, so every byte count read from it is a lower bound")


def load_trace(path: str | Path, field_name: str = "trace") -> TraceFile:
    """A peakledger JSON trace, a gzip'd one, or a CUDA snapshot pickle, told apart by content."""
    data = _unpacked(read_input(path, field_name, TRACE_FILE_LIMIT), path, field_name)
    if data[:1] == b"\x80":  # a pickle (protocol 2+): what torch.cuda.memory._dump_snapshot writes
        devices = parse_snapshot_devices(safe_loads(data, field_name), field_name=field_name)
        allocated, reserved = merge_devices(devices)
        if not allocated.events:
            raise TraceFormatError(f"{path}: the CUDA snapshot holds no allocations to read", field_name)
        notes = tuple((f"device {t.device}: {p}" if len(devices) > 1 else p) for t in devices for p in t.problems)
        return TraceFile(str(path), "CUDA snapshot", allocated, any(t.truncated for t in devices), notes, reserved)
    return TraceFile(str(path), "peakledger trace", _json_log(data, path, field_name))
