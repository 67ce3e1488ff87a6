"""Event logs on disk: compact, versioned JSON, for measured traces and simulated runs alike.

Layout (format "peakledger-trace", version 1):

    {"format": "peakledger-trace", "version": 1, "source": "torch-dispatch-tracker",
     "metadata": {...torch version, model config, training setup...},
     "blocks": [[id, nbytes, category, name, dtype, shape, state, shard_factor, rank, pool], ...],
     "events": [[seq, time, action, block_id, phase, step, micro_batch, stream, op], ...]}

Blocks are stored once and events refer to them, so a trace is a fraction of a naive dump. Loading
checks the format and version and every reference, and raises `TraceFormatError` saying what is wrong.
Files are written atomically (temporary file, then rename), keys sorted: same log, same bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..simulator.files import write_atomic
from ..simulator.events import Action, Block, Category, Event, EventLog, OptimizerState, Phase, Pool, Stream

FORMAT = "peakledger-trace"
VERSION = 1


class TraceFormatError(ValueError):
    pass


def to_json(log: EventLog) -> dict:
    blocks: dict[int, Block] = {}
    for e in log.events:
        blocks.setdefault(e.block.id, e.block)
    return {
        "format": FORMAT, "version": VERSION, "source": log.source, "metadata": log.metadata,
        "blocks": [[b.id, b.nbytes, b.category.value, b.name, b.dtype, list(b.shape),
                    b.state.value if b.state else None, b.shard_factor, b.rank, b.pool.value] for b in blocks.values()],
        "events": [[e.seq, e.time, e.action.value, e.block.id, e.phase.value, e.step, e.micro_batch, e.stream.value,
                    e.op] for e in log.events],
    }


def from_json(data: dict) -> EventLog:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceFormatError(f"not a peakledger trace (expected format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise TraceFormatError(f"trace version {data.get('version')!r} is not supported; this peakledger reads {VERSION}")
    try:
        blocks = {}
        for bid, nbytes, cat, name, dtype, shape, state, shard, rank, pool in data["blocks"]:
            blocks[bid] = Block(id=bid, nbytes=int(nbytes), category=Category(cat), name=name, dtype=dtype,
                                shape=tuple(shape), state=OptimizerState(state) if state else None,
                                shard_factor=shard, rank=rank, pool=Pool(pool))
        events = [Event(seq=seq, time=float(t), action=Action(a), block=blocks[bid], phase=Phase(ph), step=step,
                        micro_batch=mb, stream=Stream(st), op=op)
                  for seq, t, a, bid, ph, step, mb, st, op in data["events"]]
    except KeyError as e:
        raise TraceFormatError(f"event refers to unknown block {e}") from None
    except (TypeError, ValueError) as e:
        raise TraceFormatError(f"malformed trace: {e}") from None
    return EventLog(events=events, source=data.get("source", "?"), metadata=data.get("metadata", {}))


def with_event_index_times(log: EventLog) -> EventLog:
    """The same log with `time` = event index: measured wall-clock times differ run to run, and a
    stored reference trace should be byte-for-byte reproducible."""
    events = [dataclasses.replace(e, time=float(e.seq)) for e in log.events]
    return EventLog(events=events, source=log.source, metadata={**log.metadata, "time": "event index"},
                    ooms=log.ooms)


def save_log(log: EventLog, path: str | Path) -> None:
    write_atomic(path, (json.dumps(to_json(log), sort_keys=True, separators=(",", ":")) + "\n").encode())


def load_log(path: str | Path) -> EventLog:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceFormatError(f"file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path} is not JSON: {e}") from None
    return from_json(data)
