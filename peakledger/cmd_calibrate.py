"""`peakledger calibrate`: peakledger's predictions fitted to your own measured peaks (analysis/calibrate.py).

    peakledger calibrate fit [scenario flags] --csv measured.csv --output calib.json
    peakledger calibrate fit [scenario flags] --snapshot a.pickle --case "seq_len=512" \\
                                              --snapshot b.pickle --case "seq_len=2048" --output calib.json
    peakledger calibrate fit [scenario flags] --case "seq_len=512 measured_allocated=20.5GiB" --case ... --output c.json
    peakledger calibrate apply --calibration calib.json [scenario flags]

A row is a scenario (the flags, with the row's fields on top: a CSV's columns or a --case's key=value pairs,
named as the scenario flags are, `--micro-batch` -> micro_batch) and its measured peaks: `measured_allocated`
and optionally `measured_reserved` (bytes, or 12.5GiB, 800MB), or a CUDA snapshot (`snapshot` column, or the
--snapshot the --case belongs to: its allocated peak, and its reserved peak rebuilt from the segments at dump
time and the trace's segment events). Every row gives its seq_len; every other field must be the same in all
rows (one calibration per setup). Paths in a CSV are read from the current folder, as flags are.
Bad input is an InputError naming the input and what is allowed (the CLI: one line, exit 2).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import dataclass

from . import api
from .analysis.calibrate import (
    CalibrationError,
    Measurement,
    apply_calibration,
    calibrate,
    calibration_json,
    check_setup,
    describe_setup,
    load_calibration,
    predicted_reserved,
    recheck_seq_len,
    setup_differences,
    setup_key,
    stale_check,
    to_json,
)
from .analysis.units import format_bytes, parse_bytes
from .cli_common import add_scenario_flags
from .inputs import MODEL_FLAG_TYPES, MODEL_SOURCES, TRAINING_KNOBS, scenario_from_args
from .models.config import SETUP_KNOBS
from .simulator.numbers import float_text, int_text
from .simulator.safe_io import InputError, check_outputs, read_input, read_text, write_atomic
from .traces.cuda_snapshot import TRACE_FILE_LIMIT, SnapshotError, parse_snapshot, safe_loads

CSV_LIMIT = 16 << 20
MEASURED = ("measured_allocated", "measured_reserved", "snapshot")
_MODEL_TYPES = dict(MODEL_FLAG_TYPES)
_SETUP_DEFAULTS = {k.name: k.default for k in SETUP_KNOBS}
# field (as a CSV column / case key) -> where scenario_from_args reads it on the namespace
FIELD_DESTS = {**{n: n for n in ("scenario", *MODEL_SOURCES, "describer", "device", "headroom")},
               **{n: f"model_{n}" for n in _MODEL_TYPES}, **{n: n for n in TRAINING_KNOBS}}
ALLOWED = sorted(FIELD_DESTS) + list(MEASURED)


@dataclass(frozen=True)
class Row:
    where: str  # "m.csv line 3", "--case 2"
    fields: tuple[tuple[str, str], ...]  # scenario field -> text, as given
    measured_allocated: str | None = None
    measured_reserved: str | None = None
    snapshot: str | None = None


# -- rows in ---------------------------------------------------------------------------------------------------

# a measurements file never names code to run or a file to read as the model (a file handed on must not make
# peakledger import a module or read a path of its choosing): the model comes from the command line
NOT_IN_CSV = {"module": "--module", "scenario": "--scenario", "hf_config": "--hf-config"}


def _key(name: str, field: str, where: str) -> str:
    key = name.strip().replace("-", "_")
    if field == "csv" and key in NOT_IN_CSV:
        raise InputError(field, f"{where}: a measurements file never names code or a model file (column "
                                f"{name.strip()!r}); give the model once on the command line with {NOT_IN_CSV[key]}")
    if key not in FIELD_DESTS and key not in MEASURED:
        allowed = [a for a in ALLOWED if field != "csv" or a not in NOT_IN_CSV]
        raise InputError(field, f"{where}: unknown field {name.strip()!r}; allowed: {', '.join(allowed)}")
    return key


def _row(where: str, items: dict[str, str], snapshot: str | None = None, field: str = "csv") -> Row:
    items = {k: v.strip() for k, v in items.items() if v is not None and v.strip() != ""}
    if snapshot is not None:
        for k in MEASURED:
            if k in items:
                raise InputError(field, f"{where}: {k} is given for the row of --snapshot {snapshot}: the snapshot "
                                        "is its measurement; drop one")
        items["snapshot"] = snapshot
    if "snapshot" in items and ("measured_allocated" in items or "measured_reserved" in items):
        raise InputError(field, f"{where} gives both a snapshot and measured bytes: a row is measured one way; "
                                "drop one")
    if "snapshot" not in items and "measured_allocated" not in items:
        raise InputError(field, f"{where} has no measurement: give measured_allocated (bytes or 12.5GiB) or a "
                                "snapshot")
    if "seq_len" not in items:
        raise InputError(field, f"{where} has no seq_len: a calibration is over the sequence length, so every row "
                                "gives the seq_len it was measured at")
    return Row(where, tuple((k, v) for k, v in items.items() if k not in MEASURED), items.get("measured_allocated"),
               items.get("measured_reserved"), items.get("snapshot"))


def rows_from_csv(path: str) -> list[Row]:
    text = read_text(path, "csv", CSV_LIMIT).lstrip("\ufeff")
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    while header is not None and not any(c.strip() for c in header):
        header = next(reader, None)
    if header is None:
        raise InputError("csv", f"{path} is empty: give a header of scenario fields (seq_len, ...) plus "
                                "measured_allocated [measured_reserved] or snapshot, and one row per measurement")
    names = [_key(c, "csv", f"{path} header") for c in header]
    if len(set(names)) != len(names):
        raise InputError("csv", f"{path}: a column is given twice in the header {header}")
    if "seq_len" not in names:
        raise InputError("csv", f"{path} has no seq_len column: every row gives the seq_len it was measured at")
    if "measured_allocated" not in names and "snapshot" not in names:
        raise InputError("csv", f"{path} has neither a measured_allocated nor a snapshot column: give the measured "
                                "peak of each row (bytes or 12.5GiB) or its CUDA snapshot")
    rows = []
    for cells in reader:
        if not any(c.strip() for c in cells):
            continue
        where = f"{path} line {reader.line_num}"
        if len(cells) != len(names):
            raise InputError("csv", f"{where} has {len(cells)} cells, the header {len(names)}")
        rows.append(_row(where, dict(zip(names, cells))))
    if not rows:
        raise InputError("csv", f"{path} has a header but no rows: give one row per measurement")
    return rows


def rows_from_cases(cases: list[str], snapshots: list[str]) -> list[Row]:
    if snapshots and len(snapshots) != len(cases):
        raise InputError("case", f"{len(snapshots)} --snapshot and {len(cases)} --case: give each --snapshot the "
                                 "--case of the scenario it was recorded with (at least its seq_len), in order")
    rows = []
    for i, text in enumerate(cases):
        where = f"--case {i + 1}"
        items: dict[str, str] = {}
        for item in text.split():
            key, eq, value = item.partition("=")
            if not eq:
                raise InputError("case", f"expected key=value in {text!r}, got {item!r}")
            key = _key(key, "case", where)
            if key in items:
                raise InputError("case", f"{key} is given twice in {text!r}")
            items[key] = value
        rows.append(_row(where, items, snapshots[i] if snapshots else None, "case"))
    return rows


def _convert(key: str, text: str, where: str):
    """A field's text as its flag would give it: ints, floats, true/false, comma lists."""
    kind = _MODEL_TYPES.get(key) or type(_SETUP_DEFAULTS.get(key, ""))
    if key == "headroom":
        kind = float
    try:
        if kind is bool:
            value = {"true": True, "false": False}.get(text.lower())
            if value is None:
                raise ValueError
            return value
        if kind is tuple:
            items = [x.strip() for x in text.split(",") if x.strip()]
            return items if key == "frozen" else tuple(_number(int_text, x) if key == "checkpoint_layers" else x
                                                       for x in items)
        return _number({int: int_text, float: float_text}[kind], text) if kind in (int, float) else text
    except ValueError:
        allowed = {bool: "true or false", tuple: "comma-separated values", int: "an integer"}.get(kind, "a number")
        raise InputError(key, f"{where}: expected {allowed}, got {text!r}") from None


def _number(read, text: str):
    value = read(text)  # ASCII digits only (simulator/numbers.py)
    if value is None:
        raise ValueError(text)
    return value


def row_scenario(args, row: Row):
    """The row's scenario: the command's scenario flags with the row's fields on top."""
    ns = argparse.Namespace(**vars(args))
    given = dict(row.fields)
    if any(k in MODEL_SOURCES for k in given):  # the row's model source replaces the flags'
        for k in MODEL_SOURCES:
            setattr(ns, k, None)
    for key, text in given.items():
        setattr(ns, FIELD_DESTS[key], _convert(key, text, row.where))
    try:
        return scenario_from_args(ns)
    except InputError as e:
        raise InputError(e.field, f"{e.message} ({row.where})") from None


def _bytes(text: str, name: str, where: str) -> int:
    """A measured size: a number without a unit is bytes here (a measurement column), any size."""
    value = parse_bytes(text, f"{name} ({where})", plain_bytes=True)
    if value <= 0:
        raise InputError(name, f"{where}: must be > 0 bytes, got {text!r}")
    return value


def snapshot_peaks(path: str) -> tuple[int, int | None, str | None]:
    """(allocated peak, reserved peak or None, why no reserved peak) of a CUDA snapshot's one traced device.
    The reserved peak: the snapshot reader's own (`reserved_peak_bytes`, from the state at record start) where
    it has one, else the segments at dump time less the trace's segment events, and its running maximum."""
    data = safe_loads(read_input(path, "snapshot", TRACE_FILE_LIMIT), "snapshot")
    traces = data.get("device_traces") if isinstance(data, dict) else None
    devices = [i for i, t in enumerate(traces) if t] if isinstance(traces, list) else []
    if len(devices) > 1:
        raise SnapshotError(f"{path} holds traces of devices {devices}: calibrate reads one device's run per "
                            "snapshot; dump one snapshot per rank", "snapshot")
    trace = parse_snapshot(data, devices[0] if devices else 0, "snapshot")
    allocated = trace.peak_bytes()
    if hasattr(trace, "reserved_peak_bytes"):
        return allocated, trace.reserved_peak_bytes(), None
    sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    steps = [sign[e["action"]] * e["size"] for e in traces[trace.device] if e.get("action") in sign]
    sizes = [s.get("total_size") for s in data["segments"] if s.get("device", trace.device) == trace.device]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        return allocated, None, f"{path}: its segments do not all give total_size"
    running = best = sum(sizes) - sum(steps)
    if running < 0:
        return allocated, None, f"{path}: its segment events free more than its segments hold"
    for s in steps:
        running += s
        best = max(best, running)
    return allocated, best, None


# -- fit -----------------------------------------------------------------------------------------------------

def cmd_fit(args) -> int:
    if args.seq_len is not None:
        raise InputError("seq_len", "calibrate fit reads the seq_len of every row (a CSV column or each --case); "
                                    "--seq-len does not apply: drop it")
    if bool(args.csv) == bool(args.case or args.snapshot):
        raise InputError("csv", "give the measurements as --csv FILE, or as --case 'key=value ...' (each with its "
                                "--snapshot FILE, or measured_allocated=BYTES): one of the two")
    inputs = {f"--{n.replace('_', '-')}": getattr(args, n) for n in ("csv", "scenario", "hf_config") if
              getattr(args, n, None)}
    inputs.update({f"--snapshot {i + 1}": p for i, p in enumerate(args.snapshot or [])})
    check_outputs({"--output": args.output}, inputs)
    rows = rows_from_csv(args.csv) if args.csv else rows_from_cases(args.case or [], args.snapshot or [])
    if len(rows) < 2:
        raise InputError("csv" if args.csv else "case", f"{len(rows)} row: a calibration needs measurements at 2 "
                                                        "sequence lengths at least (3 or more also give a "
                                                        "leave-one-out error)")
    scenarios = [row_scenario(args, r) for r in rows]
    first = setup_key(scenarios[0])
    for row, sc in zip(rows[1:], scenarios[1:]):
        diffs = setup_differences(first, setup_key(sc))
        if diffs:
            raise InputError("csv" if args.csv else "case",
                             f"{row.where} is another setup than {rows[0].where}: it differs in "
                             f"{', '.join(d.replace('calibrated', 'first row') for d in diffs)}; a calibration is "
                             "over seq_len with everything else fixed: fit one per setup")
    measured, notes = [], []
    for row in rows:
        if row.snapshot:
            alloc, reserved, why = snapshot_peaks(row.snapshot)
            if why:
                notes.append(f"no reserved peak from {why}")
        else:
            alloc = _bytes(row.measured_allocated, "measured_allocated", row.where)
            reserved = _bytes(row.measured_reserved, "measured_reserved", row.where) if row.measured_reserved else None
        measured.append((alloc, reserved))
    given = [r.where for r, (_, res) in zip(rows, measured) if res is not None]
    if given and len(given) < len(rows) and not any(r.snapshot for r in rows):
        missing = [r.where for r, (_, res) in zip(rows, measured) if res is None]
        raise InputError("measured_reserved", f"given for {', '.join(given)} but not for {', '.join(missing)}: "
                                              "give it for every row or for none")
    cache: dict = {}
    allocated_rows, reserved_rows = [], []
    reserved_predicted = True
    for row, sc, (alloc, res) in zip(rows, scenarios, measured):
        if repr(sc) not in cache:
            try:
                cache[repr(sc)] = api.run(sc)
            except InputError as e:
                raise InputError(e.field, f"{e.message} ({row.where})") from None
        report = cache[repr(sc)]
        allocated_rows.append(Measurement(row.where, sc.setup.batch.seq_len, report.peaks.overall.bytes, alloc))
        rp = predicted_reserved(report)
        if rp is None:
            reserved_predicted = False
        elif res is not None:
            reserved_rows.append(Measurement(row.where, sc.setup.batch.seq_len, rp, res))
    if not reserved_predicted:
        notes.append("reserved peak not calibrated: this peakledger predicts no reserved peak (its report has no "
                     "reserved_peak); allocated only")
    elif len(reserved_rows) < len(rows):
        notes.append(f"reserved peak not calibrated: {'not every row has' if reserved_rows else 'no row has'} a "
                     "measured reserved peak; allocated only")
    reserved = reserved_rows if reserved_predicted and len(reserved_rows) == len(rows) else None
    calibration = calibrate(scenarios[0], allocated_rows, reserved, tuple(notes), describe_setup(scenarios[0]))
    write_atomic(args.output, to_json(calibration))
    if args.json:
        sys.stdout.write(json.dumps(calibration_json(calibration), indent=2, sort_keys=True) + "\n")
        return 0
    lo, hi = calibration.allocated.seq_range
    print(f"calibration of {calibration.scenario}: {len(rows)} rows, seq_len {lo}..{hi}, written to {args.output}")
    for f in (calibration.allocated, calibration.reserved):
        if f is not None:
            print("\n".join(render_fit(f, args.unit)))
    for note in notes:
        print(f"note: {note}")
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def render_fit(f, unit: str) -> list[str]:
    b = lambda n: format_bytes(n, unit)  # noqa: E731
    width = max(5, *(len(r.where) for r in f.rows))
    out = [f"{f.kind} peak (residual = measured / predicted - 1; error = predicted / measured - 1):",
           f"  {'row':<{width}}  {'seq_len':>7}  {'predicted':>12}  {'measured':>12}  {'residual':>9}  "
           f"{'error before':>12}  {'after':>8}  {'left out':>8}"]
    for r in f.rows:
        out.append(f"  {r.where:<{width}}  {r.seq_len:>7}  {b(r.predicted):>12}  {b(r.measured):>12}  "
                   f"{_pct(r.residual):>9}  {_pct(r.error_before):>12}  {_pct(r.error_after):>8}  "
                   f"{_pct(r.error_leave_one_out):>8}")
    loo = f.max_abs("error_leave_one_out")
    out.append(f"  max |error|: before {f.max_abs('error_before'):.2%}, after {f.max_abs('error_after'):.2%} "
               f"(in-sample), leave-one-out " + (f"{loo:.2%}" if loo is not None else "- (needs 3 rows)"))
    out.append("  knots: " + ", ".join(f"seq_len {k.seq_len} {k.residual:+.2%}" for k in f.knots))
    return out


# -- apply ---------------------------------------------------------------------------------------------------

def cmd_apply(args) -> int:
    calibration = load_calibration(args.calibration)
    scenario = scenario_from_args(args)
    check_setup(calibration, scenario, args.calibration)  # before the simulation: another setup is refused now
    report = api.run(scenario)
    result = apply_calibration(calibration, report, scenario)
    warnings = list(result.warnings)
    known = recheck_seq_len(calibration, scenario.setup.batch.seq_len)  # is the prediction still the one calibrated?
    if known is not None:
        then = report if known == scenario.setup.batch.seq_len else api.run(scenario.with_changes(seq_len=known))
        warnings += [w for w in [stale_check(calibration, known, then.peaks.overall.bytes)] if w]
    for w in warnings:
        print(f"peakledger: warning: {w}", file=sys.stderr)
    peaks = [p for p in (result.allocated, result.reserved) if p is not None]
    if args.json:
        sys.stdout.write(json.dumps({
            "scenario": scenario.name, "seq_len": result.seq_len, "calibration": args.calibration,
            "calibrated_setup": result.scenario, "warnings": warnings, "notes": list(result.notes),
            **{p.kind: {"raw": p.raw, "calibrated": p.calibrated, "residual": p.residual.value,
                        "within_calibrated_range": p.residual.inside, "how": p.residual.how} for p in peaks},
            **({} if result.reserved else {"reserved": None})}, indent=2, sort_keys=True) + "\n")
        return 0
    print(f"{scenario.name}, seq_len {result.seq_len} (calibration {args.calibration}: {result.scenario})")
    for p in peaks:
        flag = "" if p.residual.inside else "  [outside the calibrated range]"
        print(f"  {p.kind} peak: {format_bytes(p.raw, args.unit)} predicted (raw), "
              f"{format_bytes(p.calibrated, args.unit)} calibrated (residual {p.residual.value:+.2%}, "
              f"{p.residual.how}){flag}")
    for note in result.notes:
        print(f"  note: {note}")
    return 0


def register(subparsers) -> None:
    """Add `calibrate fit` and `calibrate apply` to the `peakledger` parser's sub-commands."""
    c = subparsers.add_parser("calibrate", help="fit the predicted peaks to your own measured ones (per seq_len) "
                                                "and apply that calibration")
    cs = c.add_subparsers(dest="calibrate_command", required=True, metavar="{fit,apply}")
    f = cs.add_parser("fit", help="fit a calibration from measured peaks (CSV, --case, CUDA snapshots)",
                      description="Rows: the scenario flags with each row's fields on top; each row gives seq_len "
                                  "and its measurement. Columns / case keys: " + ", ".join(ALLOWED))
    add_scenario_flags(f)
    f.add_argument("--csv", metavar="FILE.csv", help="columns: scenario fields (seq_len required) and "
                   "measured_allocated [measured_reserved] (bytes or 12.5GiB), or snapshot (a CUDA snapshot)")
    f.add_argument("--snapshot", action="append", metavar="FILE.pickle",
                   help="a CUDA snapshot (torch.cuda.memory._dump_snapshot); the --case in the same position "
                        "gives the scenario it was recorded with")
    f.add_argument("--case", action="append", metavar="'key=value ...'",
                   help="one row: scenario fields (seq_len required) on top of the flags, and "
                        "measured_allocated=BYTES unless it belongs to a --snapshot")
    f.add_argument("--output", required=True, metavar="FILE.json", help="the calibration (written atomically)")
    f.add_argument("--json", action="store_true", help="print the calibration JSON instead of the table")
    f.set_defaults(func=cmd_fit)
    a = cs.add_parser("apply", help="a scenario's raw and calibrated predicted peaks")
    add_scenario_flags(a)
    a.add_argument("--calibration", required=True, metavar="FILE.json", help="written by calibrate fit")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_apply)


__all__ = ["register", "cmd_fit", "cmd_apply", "rows_from_csv", "rows_from_cases", "row_scenario",
           "snapshot_peaks", "Row", "ALLOWED", "CalibrationError"]
