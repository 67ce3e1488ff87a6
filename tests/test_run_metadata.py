"""The event log's typed metadata (simulator/run_metadata.py): one serialisation, the JSON object a trace stores,
read back as it was written, and trace files written before it still read."""

import dataclasses
import json
from pathlib import Path

import pytest

import peakledger.traces
from peakledger import api
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.scenario import build_scenario
from peakledger.simulator.engine import simulate
from peakledger.simulator.run_metadata import RunMetadata
from peakledger.traces.store import TraceFormatError, from_json, load_log, read_setup, save_log, to_json

OLD = sorted((Path(peakledger.traces.__file__).parent / "data").glob("*.json"))  # 2026-12-02: setups of 14 knobs


@pytest.mark.parametrize("path", OLD, ids=lambda p: p.stem)
def test_an_old_trace_file_loads_with_its_setup_read_back(path):
    stored = json.loads(path.read_text())["metadata"]
    md = load_log(path).metadata
    assert isinstance(md.setup, TrainingSetup)
    recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in stored["setup"].items()}
    assert {k: md.setup.knob(k) for k in recorded} == recorded
    later = set(md.setup.knob_values()) - set(recorded)  # knobs the file predates: their defaults
    assert later and all(md.setup.knob(k) == TrainingSetup().knob(k) for k in later)
    # every other key read into its field and written back as stored, nulls included; nothing left over
    out = md.to_json_dict()
    assert {k: v for k, v in out.items() if k != "setup"} == {k: v for k, v in stored.items() if k != "setup"}
    assert md.foreign == {} and md.autocast is None and out["autocast"] is None
    assert md.time == "event index" and md.device == "cpu" and md.model_kind in ("TransformerConfig", "MLPConfig")


def test_a_trace_written_now_reads_back_and_writes_the_same_bytes(tmp_path):
    log = load_log(OLD[0])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_log(log, a)
    again = load_log(a)
    save_log(again, b)
    assert a.read_bytes() == b.read_bytes() and again.metadata == log.metadata
    stored = json.loads(a.read_text())["metadata"]["setup"]  # the setup's one serialised form, every knob
    assert stored == json.loads(json.dumps(log.metadata.setup.knob_values()))


def test_to_and_from_json_round_trip_a_simulated_run():
    graph = describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=32, world_size=2, dp_engine="fsdp2"), "cpu")
    md = simulate(graph).metadata
    text = json.dumps(md.to_json_dict())
    back = RunMetadata.from_json_dict(json.loads(text), read_setup)
    assert back == md and json.dumps(back.to_json_dict()) == text
    assert list(md.to_json_dict()) == sorted(md.to_json_dict())  # keys sorted, as the store writes them


def test_the_keys_a_simulated_run_writes():
    """describe's keys (None ones included: a hand-written describer's `batch`), then what api.run adds."""
    graph = describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=32), "cpu")
    assert list(graph.metadata.to_json_dict()) == [
        "assumptions", "batch", "counted_flops_per_step", "describer", "describer_note", "device", "effective_batch",
        "forward_flops_per_microbatch", "model", "n_params", "n_trainable", "rank_class_ranges", "rank_classes",
        "repeat_period", "setup", "steps", "steps_simulated", "tokens_per_step"]
    assert graph.metadata.batch is None and graph.metadata.to_json_dict()["batch"] is None
    report = api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 32}, {}))
    added = set(report.metadata.to_json_dict()) - set(graph.metadata.to_json_dict())
    assert added == {"alloc_conf", "device_capacity", "empty_cache_before_save", "torch_version", "torch_rules"}
    assert report.metadata.device_capacity is None and report.metadata.to_json_dict()["device_capacity"] is None


def test_a_field_given_none_is_written_as_null_and_one_not_given_is_left_out():
    assert RunMetadata().to_json_dict() == {}
    md = RunMetadata(batch=None, device="cpu")
    assert md.to_json_dict() == {"batch": None, "device": "cpu"} and md.batch is None and md.describer is None
    assert md.updated(device=None).to_json_dict() == {"batch": None, "device": None}
    assert md.updated(batch="x").to_json_dict() == {"batch": "x", "device": "cpu"}
    assert dataclasses.replace(md, device="gpu").to_json_dict() == {"batch": None, "device": "gpu"}
    assert dataclasses.replace(md, batch="x").updated(batch=None) == md
    assert RunMetadata(steps=2, rank=1).updated(RunMetadata(autocast=None, steps=3)).to_json_dict() == \
        {"autocast": None, "rank": 1, "steps": 3}
    assert RunMetadata.from_json_dict({"batch": None}, read_setup) == RunMetadata(batch=None) != RunMetadata()
    with pytest.raises(TypeError):
        RunMetadata(a_key_no_run_writes=1)


def test_keys_this_peakledger_does_not_know_are_kept():
    data = to_json(load_log(OLD[0]))
    data["metadata"] = {**data["metadata"], "written_by": "another tool", "foreign": 1}
    log = from_json(data)
    assert log.metadata.foreign == {"written_by": "another tool", "foreign": 1}
    assert to_json(log)["metadata"] == data["metadata"]


def test_a_recorded_setup_is_read_as_validate_always_read_it_and_refused_clearly():
    assert read_setup({"micro_batch": 3, "a_knob_of_another_version": 1}) == TrainingSetup(micro_batch=3)
    assert read_setup({"frozen": ["*wte*"]}).optimizer.frozen == ("*wte*",)
    with pytest.raises(TraceFormatError, match="not one this peakledger reads"):
        read_setup({"micro_batch": 0})
    with pytest.raises(TraceFormatError, match="'setup' must be an object"):
        read_setup("fp32")
    data = to_json(load_log(OLD[0]))
    data["metadata"] = {**data["metadata"], "setup": None}
    log = from_json(data)
    assert log.metadata.setup is None and to_json(log)["metadata"]["setup"] is None
