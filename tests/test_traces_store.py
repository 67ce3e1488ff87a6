"""Stored traces: versioned JSON round trip, clear errors, committed reference traces vs the simulator."""

import json
from pathlib import Path

import pytest

import peakledger.traces
from peakledger.analysis.validate import compare_logs
from peakledger.cli import main
from peakledger.models.config import MLPConfig, TransformerConfig
from peakledger.models.fields import by_name
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.traces.store import TraceFormatError, from_json, load_log, save_log, to_json

DATA = Path(peakledger.traces.__file__).parent / "data"
REFERENCE = sorted(DATA.glob("*.json"))


def test_reference_traces_are_committed():
    assert len(REFERENCE) >= 3


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.stem)
def test_simulator_matches_each_committed_reference_trace(path):
    measured = load_log(path)
    md = measured.metadata
    cls = TransformerConfig if md.model_kind == "TransformerConfig" else MLPConfig
    model = cls(**by_name(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in md.model.items()}))
    setup = md.setup
    v = compare_logs(measured, simulate(describe(model, setup, "cpu")))
    assert abs(v.overall.error) <= 0.01
    assert md.torch_version.startswith("2.")


def test_round_trip_is_lossless_and_byte_stable(tmp_path):
    log = load_log(REFERENCE[0])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_log(log, a)
    save_log(load_log(a), b)
    assert a.read_bytes() == b.read_bytes()
    assert [(e.action, e.block, e.phase, e.step) for e in load_log(a).events] == \
        [(e.action, e.block, e.phase, e.step) for e in log.events]


def test_bad_trace_files_are_clear_errors(tmp_path):
    good = to_json(load_log(REFERENCE[0]))
    with pytest.raises(TraceFormatError, match="not a peakledger trace"):
        from_json({"hello": 1})
    with pytest.raises(TraceFormatError, match="version"):
        from_json({**good, "version": 99})
    with pytest.raises(TraceFormatError, match="unknown block"):
        from_json({**good, "blocks": good["blocks"][1:]})
    p = tmp_path / "x.json"
    p.write_text("{")
    with pytest.raises(TraceFormatError, match="not JSON"):
        load_log(p)


def test_capture_writes_a_reproducible_trace_that_validate_reads(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["capture", "--preset", "tiny-mlp", "--precision", "fp32", "--micro-batch", "8"]
    assert main(args + ["--output", str(a)]) == 0 and main(args + ["--output", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    capsys.readouterr()
    assert main(["validate", "--preset", "tiny-mlp", "--precision", "fp32", "--micro-batch", "8", "--trace", str(a),
                 "--tolerance", "0.01", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak"]["measured"] > 0
