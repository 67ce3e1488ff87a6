"""peakledger calibrate: the piecewise residual fit on hand-made rows, its file, applying it, and the command
end to end (registered on the CLI's parser here; measured values made from known residuals)."""

import argparse
import json
import pickle
import re
from types import SimpleNamespace

import pytest

from peakledger import api, build_scenario, cli, cmd_calibrate
from peakledger.analysis.calibrate import (
    Calibration,
    CalibrationError,
    Measurement,
    apply_calibration,
    calibrate,
    fit,
    from_json,
    load_calibration,
    residual_at,
    to_json,
)
from peakledger.cmd_calibrate import register, snapshot_peaks

TINY = {"preset": "tiny"}
SETUP = {"micro_batch": 8, "precision": "fp32"}
FLAGS = ["--preset", "tiny", "--micro-batch", "8", "--precision", "fp32"]


def tiny(seq_len, run=None, **changes):
    return build_scenario(dict(TINY), {**SETUP, "seq_len": seq_len, **changes}, run)


def rows(*triples):
    return [Measurement(f"r{i}", s, p, m) for i, (s, p, m) in enumerate(triples)]


# -- the fit, by hand ------------------------------------------------------------------------------------------

HAND = rows((100, 1000, 1100), (200, 2000, 2400), (400, 4000, 4000))  # residuals +10%, +20%, 0


def test_knots_are_the_measured_residuals_and_interpolate_linearly_between():
    f = fit("allocated", HAND)
    assert [(k.seq_len, k.residual, k.rows) for k in f.knots] == [(100, pytest.approx(0.1), 1),
                                                                  (200, pytest.approx(0.2), 1), (400, 0.0, 1)]
    mid = residual_at(f.knots, 150)
    assert mid.value == pytest.approx(0.15) and mid.inside and "between seq_len 100 and 200" in mid.how
    assert residual_at(f.knots, 300).value == pytest.approx(0.1)  # halfway from +20% to 0
    assert residual_at(f.knots, 200).value == pytest.approx(0.2) and residual_at(f.knots, 200).inside
    below, above = residual_at(f.knots, 50), residual_at(f.knots, 800)
    assert (below.value, below.inside) == (pytest.approx(0.1), False) and "held from seq_len 100" in below.how
    assert (above.value, above.inside) == (0.0, False)


def test_errors_before_after_and_left_out():
    f = fit("allocated", HAND)
    assert [r.error_before for r in f.rows] == pytest.approx([1000 / 1100 - 1, 2000 / 2400 - 1, 0.0])
    assert [r.error_after for r in f.rows] == [0.0, 0.0, 0.0]  # a knot per row: in-sample exact
    # left out: row 0 -> +20% held from 200: 1200 / 1100; row 1 -> 10% + (0 - 10%) * 100/300 on 2000 = 2133;
    # row 2 -> +20% held from 200: 4800 / 4000
    assert [r.error_leave_one_out for r in f.rows] == pytest.approx([1200 / 1100 - 1, 2133 / 2400 - 1, 0.2])
    assert f.max_abs("error_before") == pytest.approx(1 / 6)
    assert f.max_abs("error_after") == 0.0 and f.max_abs("error_leave_one_out") == pytest.approx(0.2)


def test_rows_at_one_seq_len_average_into_one_knot_and_two_rows_have_no_leave_one_out():
    f = fit("allocated", rows((64, 1000, 1100), (64, 1000, 1300), (128, 1000, 1000)))
    assert [(k.seq_len, k.rows) for k in f.knots] == [(64, 2), (128, 1)]
    assert f.knots[0].residual == pytest.approx(0.2)
    assert [r.error_after for r in f.rows][:2] == pytest.approx([1200 / 1100 - 1, 1200 / 1300 - 1])
    two = fit("allocated", rows((64, 1000, 1100), (128, 1000, 1000)))
    assert all(r.error_leave_one_out is None for r in two.rows) and two.max_abs("error_leave_one_out") is None


@pytest.mark.parametrize("bad, words", [
    (rows((64, 1000, 1100)), "1 row"),
    (rows((64, 1000, 1100), (64, 1000, 1200)), "every row is at seq_len 64"),
    (rows((64, 1000, 0), (128, 1000, 1000)), "measured allocated peak is 0 B"),
])
def test_a_fit_needs_two_sequence_lengths_and_positive_bytes(bad, words):
    with pytest.raises(CalibrationError, match=words):
        fit("allocated", bad)


# -- the file and applying it ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hand_calibration():
    return calibrate(tiny(16), HAND, notes=("hand-made",))


def test_file_is_deterministic_and_round_trips(hand_calibration, tmp_path):
    data = to_json(hand_calibration)
    assert data == to_json(calibrate(tiny(16), HAND, notes=("hand-made",)))
    assert data == to_json(calibrate(tiny(48), HAND, notes=("hand-made",)))  # seq_len is not pinned
    assert from_json(data.decode()) == hand_calibration
    obj = json.loads(data)
    assert obj["format"] == "peakledger-calibration" and obj["version"] == 1 and obj["reserved"] is None
    assert obj["setup"]["micro_batch"] == 8 and obj["setup"]["precision"] == "fp32"
    assert obj["setup"]["model.name"] == "tiny" and "seq_len" not in obj["setup"] and "headroom" not in obj["setup"]
    assert [k["seq_len"] for k in obj["allocated"]["knots"]] == [100, 200, 400]
    path = tmp_path / "c.json"
    path.write_bytes(data)
    assert load_calibration(path) == hand_calibration


@pytest.mark.parametrize("text, words", [
    ("not json", "not JSON"), ('{"format": "x"}', "'format' must be"),
    ('{"format": "peakledger-calibration", "version": 9}', "'version' is 9"),
])
def test_a_bad_calibration_file_is_named(text, words):
    with pytest.raises(CalibrationError, match=words):
        from_json(text, "c.json")


def test_apply_interpolates_holds_and_warns(hand_calibration):
    inside = apply_calibration(hand_calibration, 3000, tiny(150, {"headroom": 0.5}))  # headroom changes no peak
    assert inside.allocated.raw == 3000 and inside.allocated.calibrated == round(3000 * 1.15)
    assert inside.warnings == () and inside.reserved is None
    outside = apply_calibration(hand_calibration, 3000, tiny(50))
    assert outside.allocated.calibrated == round(3000 * 1.1)
    (warning,) = outside.warnings
    assert "outside the calibrated range 100..400" in warning and "seq_len 100" in warning


def test_apply_uses_a_report_and_its_reserved_peak_when_it_has_one(hand_calibration):
    reserved = Calibration(hand_calibration.scenario, hand_calibration.setup, hand_calibration.allocated,
                           fit("reserved", rows((16, 2000, 2000), (64, 2000, 3000))))
    report = api.run(tiny(40))
    r = apply_calibration(reserved, SimpleNamespace(peaks=report.peaks), tiny(40))  # a report without reserved
    assert r.allocated.raw == report.peaks.overall.bytes and r.reserved is None
    assert any("reserved" in n and "has none" in n for n in r.notes)
    fake = SimpleNamespace(peaks=report.peaks, reserved_peak=SimpleNamespace(bytes=4000))
    r = apply_calibration(reserved, fake, tiny(40))
    assert r.reserved.raw == 4000 and r.reserved.calibrated == 5000  # 0 + 50% x (40 - 16) / (64 - 16)
    assert [w for w in r.warnings if "reserved" in w] == []  # 40 is inside the reserved knots (allocated: not)


def test_apply_refuses_another_setup_naming_the_fields(hand_calibration):
    with pytest.raises(CalibrationError, match=r"micro_batch \(calibrated 8, given 4\).*precision"):
        apply_calibration(hand_calibration, 3000, build_scenario(dict(TINY), {"micro_batch": 4, "seq_len": 16}))


# -- the command ---------------------------------------------------------------------------------------------

@pytest.fixture
def main(monkeypatch, capsys):
    original = cli.build_parser

    def build_parser():
        parser = original()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "calibrate" not in sub.choices:
            register(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)

    def run(*argv):
        code = cli.main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


RESIDUALS = {16: 0.10, 32: 0.25, 64: 0.40}


@pytest.fixture(scope="module")
def measured():
    """seq_len -> (predicted, measured) with measured = predicted x (1 + the known residual)."""
    out = {}
    for s, r in RESIDUALS.items():
        p = api.run(tiny(s)).peaks.overall.bytes
        out[s] = (p, round(p * (1 + r)))
    return out


def write_csv(tmp_path, text, name="m.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fit_and_apply_end_to_end(main, measured, tmp_path):
    csv_path = write_csv(tmp_path, "preset,micro_batch,precision,seq_len,measured_allocated\n" + "".join(
        f"tiny,8,fp32,{s},{m}\n" for s, (_, m) in measured.items()))
    out_path = tmp_path / "calib.json"
    code, out, err = main("calibrate", "fit", "--csv", csv_path, "--output", out_path)
    assert code == 0, err
    assert "3 rows, seq_len 16..64" in out and "leave-one-out" in out and "allocated only" in out
    first = out_path.read_bytes()
    assert main("calibrate", "fit", "--csv", csv_path, "--output", out_path)[0] == 0
    assert out_path.read_bytes() == first  # same input, same bytes
    data = json.loads(first)
    r = {s: m / p - 1 for s, (p, m) in measured.items()}
    assert [k["residual"] for k in data["allocated"]["knots"]] == [pytest.approx(r[16]), pytest.approx(r[32]),
                                                                   pytest.approx(r[64])]
    assert data["allocated"]["max_abs_error_before"] == pytest.approx(max(abs(p / m - 1)
                                                                          for p, m in measured.values()))
    assert any("allocated only" in n for n in data["notes"])

    code, out, err = main("calibrate", "apply", "--calibration", out_path, *FLAGS, "--seq-len", "48", "--json")
    assert code == 0 and err == ""
    got = json.loads(out)["allocated"]
    p48 = api.run(tiny(48)).peaks.overall.bytes
    assert got["raw"] == p48 and got["within_calibrated_range"]
    assert got["calibrated"] == round(p48 * (1 + r[32] + (r[64] - r[32]) * 0.5))  # halfway from 32 to 64

    code, out, err = main("calibrate", "apply", "--calibration", out_path, *FLAGS, "--seq-len", "8")
    p8 = api.run(tiny(8)).peaks.overall.bytes
    assert code == 0 and "calibrated" in out and "outside the calibrated range" in out
    assert "warning: seq_len 8 is outside the calibrated range 16..64" in err
    code, out, err = main("calibrate", "apply", "--calibration", out_path, *FLAGS, "--seq-len", "8", "--json")
    assert json.loads(out)["allocated"]["calibrated"] == round(p8 * (1 + r[16]))

    data["allocated"]["rows"][1]["predicted"] += 1000  # as if fitted when peakledger predicted otherwise
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(data))
    code, out, err = main("calibrate", "apply", "--calibration", stale, *FLAGS, "--seq-len", "48")
    assert code == 0 and "predicted at seq_len 32" in err and "fit the calibration again" in err

    code, out, err = main("calibrate", "apply", "--calibration", out_path, "--preset", "tiny", "--micro-batch", "4",
                          "--precision", "fp32")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "micro_batch (calibrated 8, given 4)" in err and str(out_path) in err


def test_cases_with_base_flags_and_units(main, measured, tmp_path):
    p16, p64 = measured[16][0], measured[64][0]
    out_path = tmp_path / "c.json"
    code, out, err = main("calibrate", "fit", *FLAGS, "--case", f"seq_len=16 measured_allocated={p16 * 2}",
                          "--case", "seq-len=64 measured_allocated=1GiB", "--output", out_path, "--json")
    assert code == 0, err
    knots = json.loads(out)["allocated"]["knots"]
    assert [k["residual"] for k in knots] == [pytest.approx(1.0), pytest.approx((1 << 30) / p64 - 1)]
    assert json.loads(out) == json.loads(out_path.read_text())


def snapshot(allocs, segment_size, segment_events=(), freed=None):
    """A CUDA snapshot: one segment at 0 of `segment_size` reserved at dump time, in which the trace allocates
    `allocs` one after the other (each freed before the next, the last live at dump), after `segment_events`
    (segment_alloc of a segment at 1 << 40 that stays; segment_free of one at 2 << 40 reserved before)."""
    e = lambda action, addr, size: {"action": action, "addr": addr, "size": size, "stream": 0,  # noqa: E731
                                    "time_us": 0, "frames": []}
    trace = [e(a, (1 if a == "segment_alloc" else 2) << 40, s) for a, s in segment_events]
    for i, size in enumerate(allocs):
        trace.append(e("alloc", i << 21, size))
        if i < len(allocs) - 1:
            trace += [e("free_requested", i << 21, size), e("free_completed", i << 21, size)]
    live = {"address": (len(allocs) - 1) << 21, "size": -(-allocs[-1] // 512) * 512,
            "requested_size": allocs[-1], "state": "active_allocated"}
    segments = [{"device": 0, "address": 0, "total_size": segment_size, "stream": 0, "segment_type": "large",
                 "blocks": [live]}]
    segments += [{"device": 0, "address": 1 << 40, "total_size": s, "stream": 0, "segment_type": "large",
                  "blocks": []} for a, s in segment_events if a == "segment_alloc"]
    return {"segments": segments, "device_traces": [trace]}


def test_snapshot_peaks_rebuild_the_reserved_start(tmp_path):
    path = tmp_path / "s.pickle"
    # at dump: 16 MiB (the block's) + 4 MiB; the trace reserved those 4 MiB, then freed 2 MiB reserved before it:
    # it started at 18 MiB, peaked at 22 MiB
    path.write_bytes(pickle.dumps(snapshot([1000, 3000, 2000], 16 << 20,
                                           [("segment_alloc", 4 << 20), ("segment_free", 2 << 20)])))
    assert snapshot_peaks(str(path)) == (3000, 22 << 20, None)


def test_snapshots_with_cases_and_a_predicted_reserved_peak(main, measured, tmp_path, monkeypatch):
    paths = []
    for s in (16, 64):
        path = tmp_path / f"s{s}.pickle"
        path.write_bytes(pickle.dumps(snapshot([measured[s][1]], 3 * measured[s][0])))
        paths += ["--snapshot", path, "--case", f"seq_len={s}"]
    real_run = api.run
    monkeypatch.setattr(cmd_calibrate.api, "run", lambda sc: SimpleNamespace(  # the reserved peak to come
        peaks=real_run(sc).peaks, reserved_peak=SimpleNamespace(bytes=2 * real_run(sc).peaks.overall.bytes)))
    code, out, err = main("calibrate", "fit", *FLAGS, *paths, "--output", tmp_path / "c.json", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [k["residual"] for k in data["allocated"]["knots"]] == [pytest.approx(0.10, abs=1e-6),
                                                                   pytest.approx(0.40, abs=1e-6)]
    assert [k["residual"] for k in data["reserved"]["knots"]] == [pytest.approx(0.5), pytest.approx(0.5)]
    code, out, err = main("calibrate", "apply", "--calibration", tmp_path / "c.json", *FLAGS, "--seq-len", "32",
                          "--json")
    res = json.loads(out)["reserved"]
    assert code == 0 and res["raw"] == 2 * measured[32][0] and res["calibrated"] == round(res["raw"] * 1.5)


HEADER = "preset,micro_batch,precision,seq_len,measured_allocated\n"


@pytest.mark.parametrize("text, words", [
    ("", "is empty"),
    (HEADER, "has a header but no rows"),
    (HEADER + "tiny,8,fp32,16,1000000\n", "1 row: a calibration needs measurements at 2 sequence lengths"),
    ("preset,micro_batch,measured_allocated\ntiny,8,1000\ntiny,8,2000\n", "has no seq_len column"),
    ("preset,seq_len\ntiny,16\ntiny,32\n", "neither a measured_allocated nor a snapshot column"),
    ("preset,colour,seq_len,measured_allocated\ntiny,red,16,1\ntiny,red,32,1\n",
     "csv: .*m.csv header: unknown field 'colour'; allowed: .*micro_batch.*measured_allocated"),
    (HEADER + "tiny,8,fp32,16,lots\ntiny,8,fp32,32,1000\n", "line 2.*cannot read 'lots'"),
    (HEADER + "tiny,8,fp32,,1000\ntiny,8,fp32,32,1000\n", "csv: .*line 2 has no seq_len"),
    (HEADER + "tiny,8,fp32,16,1000\ntiny,4,fp32,32,1000\n", r"line 3 is another setup.*micro_batch \(first row 8"),
    (HEADER + "tiny,eight,fp32,16,1000\ntiny,8,fp32,32,1000\n", "micro_batch: .*expected an integer, got 'eight'"),
    (HEADER + "tiny,8,fp99,16,1000\ntiny,8,fp32,32,1000\n", "precision.*allowed.*m.csv line 2"),
    (HEADER + "tiny,8,fp32,16,1000\ntiny,8,fp32,640,1000\n", "seq_len: .*max_seq_len 64.*m.csv line 3"),
    (HEADER.strip() + ",measured_reserved\ntiny,8,fp32,16,1000,9000\ntiny,8,fp32,32,1000,\n",
     "measured_reserved: given for .*line 2 but not for .*line 3"),
])
def test_bad_csv_exits_2_with_one_line_naming_it(main, tmp_path, text, words):
    csv_path = write_csv(tmp_path, text)
    code, out, err = main("calibrate", "fit", "--csv", csv_path, "--output", tmp_path / "c.json")
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and err.startswith("peakledger: error: ") and "Traceback" not in err
    assert re.search(words, err), err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--seq-len", "16", "--case", "seq_len=16 measured_allocated=1", "--case", "seq_len=32 measured_allocated=1"],
     "--seq-len does not apply"),
    (["--snapshot", "a.pickle", "--case", "seq_len=16", "--case", "seq_len=32"], "1 --snapshot and 2 --case"),
    (["--case", "seq_len=16", "--case", "seq_len=32 measured_allocated=1"], "has no measurement"),
    (["--snapshot", "missing.pickle", "--case", "seq_len=16", "--snapshot", "m2.pickle", "--case", "seq_len=32"],
     "snapshot: file not found: missing.pickle"),
    ([], "give the measurements as --csv FILE"),
])
def test_bad_fit_flags_exit_2(main, tmp_path, argv, words):
    code, out, err = main("calibrate", "fit", *FLAGS, *argv, "--output", tmp_path / "c.json")
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
