"""Your own allocate / free events (`peakledger ledger EVENTS`): read, checked, and made the project's event log.

A short list of events, written by hand or exported from a tool, in CSV or JSON (told by the file's extension,
.csv or .json, else by its first character: `[` or `{` is JSON). Each event is one row (CSV) or one object (JSON):

    time      a finite number (seconds, or any clock: it orders the events and is the plot's x axis)
    object    the tensor's name or id; one object is live from its alloc to its free
    bytes     a whole number of bytes (4096) or a size with a unit (4MiB, 1.5KiB, 2GB); needed on an alloc,
              may be left empty on a free (if given, it must be the allocation's)
    action    alloc or free
    storage   (optional) a storage id: the objects that name it share one block of memory, counted once,
              live while any of them is; every row naming a storage gives it the same bytes, category, pool, rank
    category  (optional, default unknown) what the memory is for: simulator/events.py's Category values
              (parameter, gradient, activation, optimizer_state, ...), or optimizer_state.exp_avg & co.
    pool      (optional, default device) device or host
    rank      (optional, default 0) the process or device index, an integer >= 0
    phase     (optional, default load) load, forward, backward, optimizer, zero_grad, checkpoint (the plot's bands)

Order: FILE ORDER. Events apply in the order the file lists them; time must never decrease, and events at the
same time apply in file order: an alloc listed before a free at the same instant is live together with the freed
object (the peak counts both); listed after the free, it is not. The peak is the first moment of the highest
occupancy. On a free row, empty optional cells mean "as allocated"; an object freed may be allocated again. Names
(object, storage) are at most 1000 printable characters.
CSV: a header line naming the columns (any order), then one row per event; blank lines and lines whose first cell
starts with `#` are skipped. JSON: a list of objects with those keys, or {"events": [...]}.

Checks, each an error naming the file, the line (CSV) or `events[i]` (JSON), the column and the allowed values: a
missing or unknown column, an empty file, an unknown action, category, pool or phase, bytes negative, not whole or
not a number, NaN or infinite times, a time earlier than the one before, a free of an object that is not live
(never allocated, or freed already), an alloc of an object that is live, a storage whose rows disagree, a file over
EVENTS_FILE_LIMIT (simulator/safe_io.py's bounded read).

The events become `Event`s of one `EventLog` (simulator/events.py), one `Block` per lifetime of a storage (or of an
object with no storage): an object's alloc allocates its storage's block when no other reference holds it, its free
frees the block when it was the last. The schema's other fields: step 0 in the load phase, else 1 (one step); stream
compute; op "alloc NAME" / "free NAME"; dtype "" (not given). So the timeline, the ledger and the peak are the
simulator's own (simulator/timeline.py, analysis/ledger.py; a user log's ledgers, peaks and timelines:
analysis/user_ledger.py); `UserLog` remembers which input event each log event came from.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass

from ..simulator import strict_json
from ..simulator.events import (
    Action,
    Block,
    Category,
    Event,
    EventLog,
    OptimizerState,
    Phase,
    Pool,
    Stream,
    new_block,
    new_event,
)
from ..simulator.numbers import float_text, int_text
from ..simulator.run_metadata import RunMetadata
from ..simulator.safe_io import InputError, read_text
from .units import UNITS, unit_scale

EVENTS_FILE_LIMIT = 16 << 20  # bytes of an events file (a hand-made list; ~400,000 CSV rows)
REQUIRED = ("time", "object", "bytes", "action")
OPTIONAL = ("storage", "category", "pool", "rank", "phase")
COLUMNS = REQUIRED + OPTIONAL
ACTIONS = tuple(a.value for a in Action)
CATEGORIES = tuple(c.value for c in Category) + tuple(f"optimizer_state.{s.value}" for s in OptimizerState)
POOLS = tuple(p.value for p in Pool)
PHASES = tuple(p.value for p in Phase)
ORDER_RULE = ("file order (events apply in the order the file lists them; time never decreases; events at the "
              "same time apply as listed)")
_ACTION = {a.value: a for a in Action}
_POOL = {p.value: p for p in Pool}
_PHASE = {p.value: p for p in Phase}
_CATEGORY = {**{c.value: (c, None) for c in Category},
             **{f"optimizer_state.{s.value}": (Category.OPTIMIZER_STATE, s) for s in OptimizerState}}
_SIZE = re.compile(r"^([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z]*)$")
MAX_DIGITS = 400  # no byte count or rank has that many
MAX_BYTES = 2**63 - 1  # one event's bytes at most (8 EiB: no device holds more)
MAX_RANK = 2**31 - 1
MAX_NAME = 1000  # characters of an object or storage name


class UserEventsError(InputError):
    """An events file that cannot be read as one (the message names the file, the row and the column)."""

    def __init__(self, message: str, field_name: str = "EVENTS") -> None:
        super().__init__(field_name, message)


@dataclass(slots=True)
class UserRow:
    """One input event as read: where it is (`where`: "f.csv line 3", "f.json events[2]"), and the block it
    refers to. `changed`: it allocated or freed that block (an `Event`); False for a reference to a storage
    that another object holds."""

    where: str
    time: float
    action: Action
    object: str
    block_id: int
    changed: bool


@dataclass
class UserLog:
    """The events of a file as the project's event log, and where each came from."""

    path: str
    kind: str  # "csv" or "json"
    log: EventLog
    rows: list[UserRow]
    event_rows: list[int]  # log.events[i] came from rows[event_rows[i]]
    storages: dict[int, str | None]  # block id -> its storage id (None: the object's own memory)

    @property
    def objects(self) -> int:
        return len({r.object for r in self.rows})

    def live_objects(self, row_index: int) -> dict[int, list[str]]:
        """The objects live right after `rows[row_index]`, by the block they are held in (in allocation order)."""
        live: dict[int, list[str]] = {}
        for r in self.rows[: row_index + 1]:
            if r.action is Action.ALLOC:
                live.setdefault(r.block_id, []).append(r.object)
            else:
                live[r.block_id].remove(r.object)
                if not live[r.block_id]:
                    del live[r.block_id]
        return live


# -- reading ---------------------------------------------------------------------------------------------------

def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def time_text(t: float) -> str:
    """A time as the messages and the timeline CSV write it: a whole number without ".0" (below 2^53), else its repr."""
    return str(int(t)) if t.is_integer() and abs(t) < 2**53 else repr(t)


class _At:
    """Where a value is, for messages: "f.csv line 3, column 'bytes'" (CSV) or "f.json events[2], key 'bytes'"."""

    def __init__(self, where: str, word: str) -> None:
        self.where, self.word = where, word

    def error(self, name: str, message: str) -> UserEventsError:
        return UserEventsError(f"{self.where}, {self.word} {name!r}: {message}")


def _absent(value) -> bool:
    return value is None or (isinstance(value, str) and value == "")


def _text(value, at: _At, name: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise at.error(name, f"must be a non-empty name or id, got {_show(value)}")
    if not value.strip().isprintable() or len(value.strip()) > MAX_NAME:
        raise at.error(name, f"{_show(value)} is not a name: at most {MAX_NAME} printable characters, no control "
                             "characters (tabs, newlines, NUL)")
    return value.strip()


def _choice(value, at: _At, name: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip() not in allowed:
        raise at.error(name, f"{_show(value)} is not one of the allowed values: {', '.join(allowed)}")
    return value.strip()


def _time(value, at: _At) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise at.error("time", f"must be a number, got {_show(value)}")
    try:
        t = float_text(value) if isinstance(value, str) else float(value)  # (ASCII digits only)
    except OverflowError:
        t = math.inf
    if t is None:
        raise at.error("time", f"{_show(value)} is not a number (ASCII digits 0-9)")
    if math.isnan(t):
        raise at.error("time", "NaN is not a time: give a finite number")
    if math.isinf(t):
        raise at.error("time", f"{_show(value)} is not finite: give a finite number")
    return t


def _bytes(value, at: _At) -> int:
    what = "give a whole number of bytes >= 0 (4096) or a size with a unit (4MiB, 1.5KiB, 2GB; units: " \
           f"{', '.join(UNITS)})"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise at.error("bytes", f"{value} is negative: {what}")
        return _at_most(value, at)
    if isinstance(value, float):
        if math.isnan(value):
            raise at.error("bytes", f"NaN is not a byte count: {what}")
        raise at.error("bytes", f"{_show(value)} is a JSON float, not a whole number: {what}")
    if not isinstance(value, str):
        raise at.error("bytes", f"{_show(value)} is not a size: {what}")
    s = value.strip()
    if s.lower().lstrip("+-") == "nan":
        raise at.error("bytes", f"NaN is not a byte count: {what}")
    if s.startswith("-"):
        raise at.error("bytes", f"{_show(value)} is negative: {what}")
    m = _SIZE.match(s.lstrip("+"))
    if not m:
        raise at.error("bytes", f"cannot read {_show(value)}: {what}")
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
    try:
        scale = unit_scale(unit) if unit else 1  # case-sensitive: 1Mb is refused, not read as 1 MB
    except ValueError as e:
        raise at.error("bytes", f"cannot read {_show(value)}: {e}") from None
    if len(whole) + len(frac) > MAX_DIGITS:
        raise at.error("bytes", f"{len(whole) + len(frac):,} digits is not a byte count: {what}")
    part = int(frac) * scale if frac else 0
    if part % 10 ** len(frac):
        raise at.error("bytes", f"{_show(value)} is not a whole number of bytes: {what}")
    return _at_most(int(whole) * scale + part // 10 ** len(frac), at)


def _at_most(n: int, at: _At) -> int:
    if n > MAX_BYTES:
        raise at.error("bytes", f"over {MAX_BYTES:,} B (2^63 - 1), more than any memory holds")
    return n


def _rank(value, at: _At) -> int:
    if isinstance(value, str) and len(value.strip()) <= MAX_DIGITS:
        number = int_text(value.strip())  # ASCII digits only: a Thai 3 or a superscript 2 is not a rank
        value = value if number is None else number
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RANK:
        return value
    raise at.error("rank", f"{_show(value)} is not an integer in [0, {MAX_RANK}] (the process or device index)")


def _known(table: dict, value):
    """`table[value]` for a string it has (a JSON value may be unhashable: a list, an object), else None."""
    return table.get(value) if isinstance(value, str) else None


def _category(value, at: _At) -> tuple[Category, OptimizerState | None]:
    known = _known(_CATEGORY, value)
    if known:
        return known
    text = _choice(value, at, "category", CATEGORIES)
    cat, _, state = text.partition(".")
    return Category(cat), OptimizerState(state) if state else None


def _csv_records(text: str, path: str):
    """(where, {column: cell}) per data row; header and shape checked."""
    reader = csv.reader(io.StringIO(text), strict=True)
    header: list[str] | None = None
    header_line = 0
    try:
        for cells in reader:
            if not any(c.strip() for c in cells) or cells[0].lstrip().startswith("#"):
                continue
            if header is None:
                header, header_line = [c.strip() for c in cells], reader.line_num
                _check_header(header, path, header_line)
                continue
            where = f"{path} line {reader.line_num}"
            if len(cells) != len(header):
                raise UserEventsError(f"{where} has {len(cells)} cells, the header (line {header_line}) names "
                                      f"{len(header)} columns: {','.join(header)}")
            yield where, {k: c.strip() for k, c in zip(header, cells)}
    except csv.Error as e:
        raise UserEventsError(f"{path} line {reader.line_num}: not readable as CSV: {e}") from None
    if header is None:
        raise UserEventsError(f"{path} is empty: give a header line naming the columns ({','.join(REQUIRED)}, "
                              f"optionally {','.join(OPTIONAL)}) and one row per event")


def _check_header(header: list[str], path: str, line: int) -> None:
    for name in header:
        if name not in COLUMNS:
            raise UserEventsError(f"{path} line {line} (the header): unknown column {_show(name)}; allowed: "
                                  f"{', '.join(COLUMNS)}")
    twice = sorted({n for n in header if header.count(n) > 1})
    if twice:
        raise UserEventsError(f"{path} line {line} (the header): column {twice[0]!r} is given twice")
    missing = [n for n in REQUIRED if n not in header]
    if missing:
        raise UserEventsError(f"{path} line {line} (the header): missing column{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(missing)}; every events file has {', '.join(REQUIRED)}")


def _json_records(text: str, path: str):
    try:
        data = strict_json.loads(text, constants=True)  # NaN / Infinity: read, then refused where they stand
    except strict_json.JSONRefused as e:
        raise UserEventsError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserEventsError(f"{path} is not JSON: {e}") from None
    if isinstance(data, dict):
        if set(data) != {"events"}:
            raise UserEventsError(f"{path}: a JSON object holds one key, \"events\" (a list of events), got keys "
                                  f"{_show(sorted(data)[:8])}")
        data = data["events"]
    if not isinstance(data, list):
        raise UserEventsError(f"{path}: give a JSON list of events, or {{\"events\": [...]}}")
    for i, item in enumerate(data):
        where = f"{path} events[{i}]"
        if not isinstance(item, dict):
            raise UserEventsError(f"{where} is {_show(item)}, not an object with keys {', '.join(REQUIRED)}")
        for key in item:
            if key not in COLUMNS:
                raise UserEventsError(f"{where}: unknown key {_show(key)}; allowed: {', '.join(COLUMNS)}")
        missing = [k for k in REQUIRED if k not in item and not (k == "bytes" and item.get("action") == "free")]
        if missing:
            raise UserEventsError(f"{where}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}; "
                                  f"every event has {', '.join(REQUIRED)} (bytes may be left out on a free)")
        yield where, item


def read_user_events(path: str) -> UserLog:
    """The events file at `path` as a `UserLog`, every check applied (`UserEventsError` naming the row)."""
    text = read_text(path, "EVENTS", EVENTS_FILE_LIMIT).lstrip("\ufeff")
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix in (".csv", ".json"):
        kind = suffix[1:]
    else:
        kind = "json" if text.lstrip()[:1] in ("[", "{") else "csv"
    records = _json_records(text, path) if kind == "json" else _csv_records(text, path)
    return _build(records, str(path), kind)


# -- the event log ---------------------------------------------------------------------------------------------

@dataclass
class _Storage:
    nbytes: int
    category: Category
    state: OptimizerState | None
    pool: Pool
    rank: int
    where: str  # the row that first named it
    block: Block | None = None  # while live
    refs: int = 0


def _build(records, path: str, kind: str) -> UserLog:
    word = "key" if kind == "json" else "column"
    events: list[Event] = []
    rows: list[UserRow] = []
    event_rows: list[int] = []
    storages: dict[int, str | None] = {}
    named: dict[str, _Storage] = {}
    live: dict[str, tuple[Block, str | None, str]] = {}  # object -> (its block, its storage id, its alloc row)
    freed: dict[str, str] = {}  # object -> the row that last freed it
    last_time, last_where = -math.inf, ""
    alloc, compute, load = Action.ALLOC, Stream.COMPUTE, Phase.LOAD
    for where, cells in records:
        at = _At(where, word)
        get = {k: v for k, v in cells.items() if not _absent(v)}.get
        for name in ("time", "object", "action"):
            if get(name) is None:
                raise at.error(name, "is empty; every event gives its time, object and action")
        t = _time(get("time"), at)
        if t < last_time:
            raise at.error("time", f"{_show(get('time'))} is earlier than {time_text(last_time)} ({last_where}): "
                                   "times never decrease (events at the same time apply in file order)")
        action = _known(_ACTION, get("action")) or Action(_choice(get("action"), at, "action", ACTIONS))
        obj = _text(get("object"), at, "object")
        storage = None if get("storage") is None else _text(get("storage"), at, "storage")
        nbytes = None if get("bytes") is None else _bytes(get("bytes"), at)
        category = None if get("category") is None else _category(get("category"), at)
        pool = None if get("pool") is None else \
            _known(_POOL, get("pool")) or Pool(_choice(get("pool"), at, "pool", POOLS))
        rank = None if get("rank") is None else _rank(get("rank"), at)
        phase = Phase.LOAD if get("phase") is None else \
            _known(_PHASE, get("phase")) or Phase(_choice(get("phase"), at, "phase", PHASES))
        if action is alloc:
            if obj in live:
                raise at.error("object", f"{_show(obj)} is allocated again while live (allocated at "
                                         f"{live[obj][2]}, not freed since): free it first, or give another name")
            if nbytes is None:
                raise at.error("bytes", "is empty on an alloc: give the bytes it allocates (4096, 4MiB, ...)")
            cat, state = category or (Category.UNKNOWN, None)
            block, changed = _alloc(at, obj, storage, named, nbytes, cat, state, pool or Pool.DEVICE, rank or 0,
                                    len(storages))
            if block.id not in storages:
                storages[block.id] = storage
            live[obj] = (block, storage, where)
        else:
            if obj not in live:
                before = f"freed already at {freed[obj]}" if obj in freed else "never allocated"
                raise at.error("object", f"frees {_show(obj)}, which is not live ({before})")
            block, held_in, alloc_where = live.pop(obj)
            _same_as_alloc(at, obj, alloc_where, block, held_in, storage, nbytes, category, pool, rank)
            freed[obj] = where
            changed = held_in is None or _release(named[held_in])
        if changed:
            event_rows.append(len(rows))
            events.append(new_event(len(events), t, action, block, phase, 0 if phase is load else 1, -1, compute,
                                    f"{action.value} {obj}"))
        rows.append(UserRow(where, t, action, obj, block.id, changed))
        last_time, last_where = t, where
    if not rows:
        raise UserEventsError(f"{path} holds no events: give one {'row' if kind == 'csv' else 'object'} per alloc "
                              "or free")
    log = EventLog(events=events, source="user-events", metadata=RunMetadata(events_file=path, order=ORDER_RULE))
    return UserLog(path=path, kind=kind, log=log, rows=rows, event_rows=event_rows, storages=storages)


def _alloc(at: _At, obj: str, storage: str | None, named: dict[str, _Storage], nbytes: int, cat: Category,
           state: OptimizerState | None, pool: Pool, rank: int, next_id: int) -> tuple[Block, bool]:
    """The block `obj` is allocated in, and whether the alloc allocates it (not a storage already held)."""
    name = f"{cat.value}.{state.value}" if state else cat.value
    if storage is None:
        return new_block(next_id, nbytes, cat, obj, "", (), state, 1, rank, pool), True
    s = named.get(storage)
    if s is None:
        s = named[storage] = _Storage(nbytes, cat, state, pool, rank, at.where)
    mine = {"bytes": nbytes, "category": name, "pool": pool.value, "rank": rank}
    theirs = {"bytes": s.nbytes, "category": f"{s.category.value}.{s.state.value}" if s.state else s.category.value,
              "pool": s.pool.value, "rank": s.rank}
    for key, value in mine.items():
        if value != theirs[key]:
            empty = "" if key == "bytes" else " (left empty, category is unknown, pool device, rank 0)"
            raise at.error(key, f"storage {_show(storage)} has {key} {theirs[key]} at {s.where} but {value} here: "
                                f"the references of one storage share its {key}; give the same on every row naming "
                                f"it{empty}")
    s.refs += 1
    if s.block is not None:
        return s.block, False
    s.block = new_block(next_id, nbytes, cat, storage, "", (), state, 1, rank, pool)
    return s.block, True


def _release(s: _Storage) -> bool:
    """One reference of `s` freed: True when it was the last (the storage's block is freed)."""
    s.refs -= 1
    if s.refs:
        return False
    s.block = None
    return True


def _same_as_alloc(at: _At, obj: str, alloc_where: str, block: Block, held_in: str | None, storage, nbytes,
                   category, pool, rank) -> None:
    """A free's optional cells, where given, say what the alloc said."""
    given = {"storage": (storage, held_in), "bytes": (nbytes, block.nbytes), "pool": (pool, block.pool),
             "rank": (rank, block.rank), "category": (category, (block.category, block.state))}
    for key, (mine, theirs) in given.items():
        if mine is not None and mine != theirs:
            show = lambda v: (f"{v[0].value}.{v[1].value}" if v[1] else v[0].value) if key == "category" \
                else getattr(v, "value", v)  # noqa: E731
            raise at.error(key, f"the free of {_show(obj)} gives {show(mine)}, its alloc ({alloc_where}) gave "
                                f"{show(theirs)}: leave it empty on the free, or give the same")


__all__ = ["UserEventsError", "UserLog", "UserRow", "read_user_events", "EVENTS_FILE_LIMIT", "ORDER_RULE", "COLUMNS",
           "REQUIRED", "OPTIONAL", "time_text"]
