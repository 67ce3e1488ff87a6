"""Calibration: peakledger's predictions corrected by a user's own measured peaks, per sequence length.

The residual of one measurement is relative: r = measured / predicted - 1, so calibrated = predicted x (1 + r).
Measurements of one setup (every scenario field but seq_len alike) at several sequence lengths give one knot
per measured seq_len (the mean residual of the rows measured there). Between two knots the residual is
interpolated linearly in seq_len (one piece per interval); below the first knot or above the last the
nearest knot's residual is held, and the prediction is flagged as outside the calibrated range.

The fitted error of each row is predicted / measured - 1 (its relative error against the measurement):
before calibration, after (in-sample: zero at a knot unless rows share a seq_len), and with that row left
out of the fit (leave-one-out, where there are 3 rows or more: how well the pieces predict a length that
was not measured). A calibration applies only to the setup it was measured on: `apply_calibration` refuses
a scenario that differs in any field but seq_len (headroom and the scenario's name change no peak and are
not compared), naming the fields.

The calibration file is JSON (`to_json`: sorted keys, so the same fit gives the same bytes):
{"format": "peakledger-calibration", "version": 1, "scenario", "setup": {field: value}, "residual",
 "allocated": {"knots": [{"seq_len", "residual", "rows"}], "rows": [...], "max_abs_error_before",
 "max_abs_error_after", "max_abs_error_leave_one_out"}, "reserved": the same or null, "notes": [...]}.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..models.config import SETUP_KNOBS
from ..models.fields import keys_of
from ..simulator import strict_json
from ..simulator.safe_io import InputError, read_text

FORMAT = "peakledger-calibration"
VERSION = 1
CALIBRATION_FILE_LIMIT = 16 << 20
RESIDUAL_NOTE = ("measured / predicted - 1 per row; the mean at each measured seq_len is a knot; linear in seq_len "
                 "between knots, the nearest knot's held outside them; calibrated = predicted x (1 + residual)")
NOT_COMPARED = ("seq_len", "headroom", "name")  # fields a calibration does not pin (the last two change no peak)


class CalibrationError(InputError):
    """A calibration that cannot be made, read or applied; `field` names the input."""


@dataclass(frozen=True)
class Measurement:
    where: str  # the input it came from ("m.csv line 3", "run.pickle")
    seq_len: int
    predicted: int  # bytes
    measured: int  # bytes


@dataclass(frozen=True)
class Knot:
    seq_len: int
    residual: float
    rows: int  # measurements averaged into it


@dataclass(frozen=True)
class RowFit:
    where: str
    seq_len: int
    predicted: int
    measured: int
    residual: float
    error_before: float  # predicted / measured - 1
    error_after: float  # calibrated (in-sample) / measured - 1
    error_leave_one_out: float | None  # fitted without this row; None under 3 rows


@dataclass(frozen=True)
class Residual:
    value: float
    seq_len: int
    inside: bool  # within the measured seq_len range
    how: str  # "measured at seq_len 32", "interpolated between seq_len 32 and 64", "held from seq_len 64"


@dataclass(frozen=True)
class Fit:
    kind: str  # "allocated" or "reserved"
    knots: tuple[Knot, ...]
    rows: tuple[RowFit, ...]

    @property
    def seq_range(self) -> tuple[int, int]:
        return self.knots[0].seq_len, self.knots[-1].seq_len

    def max_abs(self, name: str) -> float | None:
        return max((abs(getattr(r, name)) for r in self.rows if getattr(r, name) is not None), default=None)

    def residual_at(self, seq_len: int) -> Residual:
        return residual_at(self.knots, seq_len)


@dataclass(frozen=True)
class Calibration:
    scenario: str  # what the setup is, in words
    setup: tuple[tuple[str, str], ...]  # (field, its value as canonical JSON), sorted by field
    allocated: Fit
    reserved: Fit | None
    notes: tuple[str, ...] = ()

    def setup_dict(self) -> dict:
        return {k: json.loads(v) for k, v in self.setup}


@dataclass(frozen=True)
class CalibratedPeak:
    kind: str
    raw: int
    calibrated: int
    residual: Residual


@dataclass(frozen=True)
class CalibratedPrediction:
    scenario: str
    seq_len: int
    allocated: CalibratedPeak
    reserved: CalibratedPeak | None
    warnings: tuple[str, ...]
    notes: tuple[str, ...]


# -- the setup a calibration pins ------------------------------------------------------------------------

def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def setup_fields(scenario) -> dict:
    """Every field of `scenario` a calibration pins: the device, every TrainingSetup field but seq_len and
    every field of the model ("model.<field>"; a traced model by its kind, name, source digest and batch
    knobs), each as a JSON value. `NOT_COMPARED` fields are left out."""
    out = {"device": scenario.device}
    for k in SETUP_KNOBS:
        if k.name not in NOT_COMPARED:
            out[k.name] = k.read(scenario.setup)
    model = scenario.model
    out["model.class"] = type(model).__name__
    names = dict(keys_of(type(model)))  # key -> attribute (models/fields.py: TransformerConfig's `family`)
    if out["model.class"] == "TracedModel":  # pinned by its digest (config JSON or module file bytes)
        del names["source"]
        if model.kind == "module":
            out["model.factory"] = model.source.rpartition(":")[2]
    for key, name in names.items():
        out[f"model.{key}"] = getattr(model, name)
    return {k: json.loads(_canon(_plain(v))) for k, v in out.items()}


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def setup_key(scenario) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, _canon(v)) for k, v in setup_fields(scenario).items()))


def setup_differences(pinned: tuple[tuple[str, str], ...], other: tuple[tuple[str, str], ...]) -> list[str]:
    """'field (calibrated A, given B)' for each field that differs (or that one side lacks)."""
    a, b = dict(pinned), dict(other)
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k} (calibrated {a.get(k, 'absent')}, given {b.get(k, 'absent')})")
    return out


def check_setup(calibration: Calibration, scenario, source: str = "the calibration") -> None:
    diffs = setup_differences(calibration.setup, setup_key(scenario))
    if diffs:
        raise CalibrationError("calibration", f"{source} was fitted on another setup ({calibration.scenario}); "
                                              f"this scenario differs in {', '.join(diffs)}: a calibration applies "
                                              "only to the setup it was measured on (any seq_len): fit one for "
                                              "this setup")


# -- fitting -------------------------------------------------------------------------------------------------

def knots_of(rows: list[Measurement]) -> tuple[Knot, ...]:
    by_len: dict[int, list[float]] = {}
    for r in rows:
        by_len.setdefault(r.seq_len, []).append(r.measured / r.predicted - 1)
    return tuple(Knot(s, math.fsum(v) / len(v), len(v)) for s, v in sorted(by_len.items()))


def residual_at(knots: tuple[Knot, ...], seq_len: int) -> Residual:
    """The residual at `seq_len`: a knot's, interpolated linearly between two, or the nearest one held."""
    first, last = knots[0], knots[-1]
    if seq_len < first.seq_len or seq_len > last.seq_len:
        k = first if seq_len < first.seq_len else last
        return Residual(k.residual, seq_len, False, f"held from seq_len {k.seq_len}")
    for lo, hi in zip(knots, knots[1:] + (knots[-1],)):
        if seq_len == lo.seq_len:
            return Residual(lo.residual, seq_len, True, f"measured at seq_len {lo.seq_len}")
        if lo.seq_len < seq_len < hi.seq_len:
            t = (seq_len - lo.seq_len) / (hi.seq_len - lo.seq_len)
            return Residual(lo.residual + (hi.residual - lo.residual) * t, seq_len, True,
                            f"interpolated between seq_len {lo.seq_len} and {hi.seq_len}")
    raise AssertionError("unreachable: seq_len inside the knots' range")


# a measured peak 100x the prediction (or a 100th of it) is of another setup, not a residual to carry
RESIDUAL_MIN, RESIDUAL_MAX = -0.99, 99.0
ERROR_MAX = 1e6  # a row's error, as read back from a calibration file (finite and bounded, for printing)
BYTES_MAX = 2**63 - 1  # a predicted or measured peak (int64, as torch counts bytes)


def calibrated_bytes(predicted: int, residual: float) -> int:
    """predicted x (1 + residual), to the nearest byte (Python's round: half to even)."""
    return round(predicted * (1.0 + residual))


def fit(kind: str, rows: list[Measurement], field_name: str = "measurements") -> Fit:
    """The piecewise residual of `rows` (one setup) and each row's error before, after and left out."""
    if len(rows) < 2:
        raise CalibrationError(field_name, f"{len(rows)} row{'s' if len(rows) != 1 else ''} of {kind} peaks: a "
                                           "calibration needs measurements at 2 sequence lengths at least")
    for r in rows:
        if r.predicted <= 0 or r.measured <= 0:
            which = "predicted" if r.predicted <= 0 else "measured"
            raise CalibrationError(field_name, f"{r.where}: the {which} {kind} peak is {getattr(r, which)} B; "
                                               "both must be > 0 bytes")
        if r.measured > BYTES_MAX or not RESIDUAL_MIN <= r.measured / r.predicted - 1 <= RESIDUAL_MAX:
            raise CalibrationError(field_name, f"{r.where}: the measured {kind} peak ({r.measured:,} B) is over "
                                               f"{RESIDUAL_MAX + 1:g}x or under 1/{RESIDUAL_MAX + 1:g} of the "
                                               f"prediction ({r.predicted:,} B): a measurement of another setup, not "
                                               "one to calibrate with")
    knots = knots_of(rows)
    if len(knots) < 2:
        raise CalibrationError(field_name, f"every row is at seq_len {knots[0].seq_len}: a calibration over the "
                                           "sequence length needs measurements at 2 sequence lengths at least")
    out = []
    for i, r in enumerate(rows):
        after = calibrated_bytes(r.predicted, residual_at(knots, r.seq_len).value) / r.measured - 1
        loo = None
        if len(rows) >= 3:
            rest = knots_of(rows[:i] + rows[i + 1:])
            loo = calibrated_bytes(r.predicted, residual_at(rest, r.seq_len).value) / r.measured - 1
        out.append(RowFit(r.where, r.seq_len, r.predicted, r.measured, r.measured / r.predicted - 1,
                          r.predicted / r.measured - 1, after, loo))
    return Fit(kind, knots, tuple(out))


def calibrate(scenario, allocated: list[Measurement], reserved: list[Measurement] | None = None,
              notes: tuple[str, ...] = (), description: str | None = None) -> Calibration:
    """A calibration of `scenario`'s setup (any seq_len) from measured allocated (and reserved) peaks."""
    return Calibration(description or describe_setup(scenario), setup_key(scenario), fit("allocated", allocated),
                       fit("reserved", reserved) if reserved else None, tuple(notes))


def describe_setup(scenario) -> str:
    s = scenario.setup
    parts = [
        f"{scenario.model.name} on {scenario.device}",
        f"micro_batch {s.batch.micro_batch}",
        s.precision.name,
        s.optimizer.name,
    ]
    if s.mesh.world_size > 1:
        parts.append(
            f"world_size {s.mesh.world_size} ({s.data_parallel.engine}, "
            f"zero_stage {s.data_parallel.deepspeed.zero_stage})"
        )
    if s.checkpointing.policy != "none":
        parts.append(f"checkpointing {s.checkpointing.policy}")
    return ", ".join(parts)


# -- applying -----------------------------------------------------------------------------------------------

def _peak_bytes(value) -> int | None:
    value = getattr(value, "bytes", value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def predicted_reserved(report) -> int | None:
    """The report's predicted reserved peak in bytes (the caching allocator's, on a CUDA device profile), or None
    where the report has none (the cpu profile: then only the allocated peak is calibrated)."""
    gpu = getattr(report, "gpu", None)
    if gpu is not None:
        return gpu.reserved_peak.reserved
    return _peak_bytes(getattr(report, "reserved_peak", None))


def apply_calibration(calibration, report_or_peak, scenario) -> CalibratedPrediction:
    """`scenario`'s prediction calibrated. `calibration`: a Calibration or the path of its JSON file;
    `report_or_peak`: the scenario's Report (`api.run(scenario)`: its allocated peak, and its reserved peak
    when it has `reserved_peak`) or the predicted allocated peak in bytes. Raises CalibrationError for
    another setup; a seq_len outside the calibrated range is calibrated with the nearest knot, and warned."""
    source = "the calibration"
    if not isinstance(calibration, Calibration):
        source = str(calibration)
        calibration = load_calibration(calibration)
    check_setup(calibration, scenario, source)
    peaks = getattr(report_or_peak, "peaks", None)
    raw = _peak_bytes(peaks.overall) if peaks is not None else _peak_bytes(report_or_peak)
    if raw is None:
        raise CalibrationError("report_or_peak", f"expected a Report or a peak in bytes, got {report_or_peak!r}")
    raw_reserved = predicted_reserved(report_or_peak) if peaks is not None else None
    seq_len = scenario.setup.batch.seq_len
    warnings, notes = [], []
    out = {}
    for fit_, value in ((calibration.allocated, raw), (calibration.reserved, raw_reserved)):
        if fit_ is None:
            continue
        if value is None:
            notes.append(f"the {fit_.kind} peak is calibrated but this prediction has none: {fit_.kind} not applied")
            continue
        r = fit_.residual_at(seq_len)
        out[fit_.kind] = CalibratedPeak(fit_.kind, value, calibrated_bytes(value, r.value), r)
        if not r.inside:
            lo, hi = fit_.seq_range
            warnings.append(f"seq_len {seq_len} is outside the calibrated range {lo}..{hi}: the calibrated {fit_.kind} "
                            f"peak holds the residual of seq_len {lo if seq_len < lo else hi} ({r.value:+.2%}), "
                            "an extrapolation")
    if calibration.reserved is None:
        notes.append("the reserved peak is not calibrated (the calibration has allocated peaks only)")
    return CalibratedPrediction(calibration.scenario, seq_len, out["allocated"], out.get("reserved"),
                                tuple(warnings), tuple(notes))


def recheck_seq_len(calibration: Calibration, seq_len: int) -> int | None:
    """The measured seq_len nearest `seq_len` (the smaller on a tie), to re-predict for `stale_check`."""
    lens = sorted({r.seq_len for r in calibration.allocated.rows})
    return min(lens, key=lambda s: (abs(s - seq_len), s)) if lens else None


def stale_check(calibration: Calibration, seq_len: int, predicted: int) -> str | None:
    """A warning when this peakledger predicts the allocated peak at a measured seq_len otherwise than when the
    calibration was fitted (its residuals are against the old prediction), else None."""
    then = next((r.predicted for r in calibration.allocated.rows if r.seq_len == seq_len), None)
    if then is None or then == predicted:
        return None
    return (f"the allocated peak predicted at seq_len {seq_len} is {predicted:,} B now, {then:,} B when the "
            f"calibration was fitted ({predicted / then - 1:+.2%}): peakledger's model changed since, so the "
            "residuals no longer apply as measured; fit the calibration again")


# -- the file -----------------------------------------------------------------------------------------------

def _fit_json(f: Fit) -> dict:
    return {"knots": [dataclasses.asdict(k) for k in f.knots], "rows": [dataclasses.asdict(r) for r in f.rows],
            "max_abs_error_before": f.max_abs("error_before"), "max_abs_error_after": f.max_abs("error_after"),
            "max_abs_error_leave_one_out": f.max_abs("error_leave_one_out")}


def calibration_json(c: Calibration) -> dict:
    return {"format": FORMAT, "version": VERSION, "scenario": c.scenario, "setup": c.setup_dict(),
            "residual": RESIDUAL_NOTE, "allocated": _fit_json(c.allocated),
            "reserved": _fit_json(c.reserved) if c.reserved else None, "notes": list(c.notes)}


def to_json(c: Calibration) -> bytes:
    return (json.dumps(calibration_json(c), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_ROW_TYPES = {"where": lambda x: isinstance(x, str), "seq_len": _int, "predicted": _int, "measured": _int,
              "residual": _num, "error_before": _num, "error_after": _num,
              "error_leave_one_out": lambda x: x is None or _num(x)}


_ROW_ERRORS = ("residual", "error_before", "error_after", "error_leave_one_out")


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _read_fit(kind: str, data, bad) -> Fit:
    if not isinstance(data, dict) or not isinstance(data.get("knots"), list) or not isinstance(data.get("rows"), list):
        bad(f"'{kind}' must be an object with lists 'knots' and 'rows'")
    knots = []
    for i, k in enumerate(data["knots"]):
        if not (isinstance(k, dict) and set(k) == {"seq_len", "residual", "rows"} and _int(k["seq_len"])
                and 0 < k["seq_len"] <= BYTES_MAX and _num(k["residual"])
                and RESIDUAL_MIN <= k["residual"] <= RESIDUAL_MAX and _int(k["rows"]) and k["rows"] > 0):
            bad(f"{kind}.knots[{i}] must be {{seq_len: int > 0, residual: number in [{RESIDUAL_MIN:g}, "
                f"{RESIDUAL_MAX:g}], rows: int > 0}}, got {_brief(k)}")
        knots.append(Knot(k["seq_len"], float(k["residual"]), k["rows"]))
    if not knots or any(a.seq_len >= b.seq_len for a, b in zip(knots, knots[1:])):
        bad(f"{kind}.knots must be one knot at least, in increasing seq_len")
    rows = []
    for i, r in enumerate(data["rows"]):
        if not (isinstance(r, dict) and set(r) == set(_ROW_TYPES) and all(t(r[n]) for n, t in _ROW_TYPES.items())
                and all(0 < r[n] <= BYTES_MAX for n in ("seq_len", "predicted", "measured"))
                and all(abs(r[n]) <= ERROR_MAX for n in _ROW_ERRORS if r[n] is not None)):
            bad(f"{kind}.rows[{i}] must hold {', '.join(_ROW_TYPES)} (numbers, where a string; sizes in (0, 2^63); "
                f"residuals and errors within {ERROR_MAX:g}), got {_brief(r)}")
        rows.append(RowFit(**{n: float(v) if n not in ("where", "seq_len", "predicted", "measured") and v is not None
                              else v for n, v in r.items()}))
    return Fit(kind, tuple(knots), tuple(rows))


def from_json(text: str, path: str = "calibration") -> Calibration:
    """A calibration file's text, checked: CalibrationError naming the file and what is wrong."""
    def bad(what: str):
        raise CalibrationError("calibration", f"{path} is not a peakledger calibration this version reads: {what}")

    try:
        data = strict_json.loads(text)
    except strict_json.JSONRefused as e:
        bad(str(e))
    except ValueError as e:
        bad(f"not JSON ({e})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        bad(f"'format' must be {FORMAT!r} (written by peakledger calibrate fit)")
    if data.get("version") != VERSION:
        bad(f"'version' is {data.get('version')!r}; this peakledger reads version {VERSION}")
    if not isinstance(data.get("scenario"), str) or not isinstance(data.get("setup"), dict) or not data["setup"]:
        bad("'scenario' must be a string and 'setup' a non-empty object of scenario fields")
    if not isinstance(data.get("notes", []), list) or not all(isinstance(n, str) for n in data.get("notes", [])):
        bad("'notes' must be a list of strings")
    setup = tuple(sorted((k, _canon(v)) for k, v in data["setup"].items()))
    reserved = None if data.get("reserved") is None else _read_fit("reserved", data["reserved"], bad)
    return Calibration(data["scenario"], setup, _read_fit("allocated", data.get("allocated"), bad), reserved,
                       tuple(data.get("notes", [])))


def load_calibration(path) -> Calibration:
    return from_json(read_text(path, "calibration", CALIBRATION_FILE_LIMIT), str(path))


__all__ = ["Measurement", "Knot", "RowFit", "Residual", "Fit", "Calibration", "CalibratedPeak", "CalibratedPrediction",
           "CalibrationError", "setup_fields", "setup_key", "setup_differences", "check_setup", "predicted_reserved",
           "recheck_seq_len", "stale_check", "knots_of", "residual_at", "calibrated_bytes", "fit", "calibrate",
           "apply_calibration", "calibration_json", "to_json", "from_json", "load_calibration", "FORMAT", "VERSION"]
