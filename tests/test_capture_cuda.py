"""`capture --device-kind cuda` and `validate --trace` of CUDA traces, without a GPU: the capture's program run on
the CPU (bf16-mixed as the simulator describes it), its loop marks and step labels, its host and device guards,
the scenario it records, and a whole capture -> validate round trip with the CUDA pieces of torch stood in for
(the snapshot it dumps is the simulation of the same run on the GPU's profile, placed in the loop's marks)."""

import dataclasses
import itertools
import json
import pickle

import pytest
import torch

import peakledger.traces.cuda_capture as cc
from peakledger.analysis.validate import compare_logs, measured_description, render_validation
from peakledger.cli import main
from peakledger.inputs import CUDA_HOST_BYTES, check_real_run, host_need, real_run_scenario
from peakledger.models.config import ConfigError
from peakledger.models.training import describe
from peakledger.scenario import build_scenario
from peakledger.simulator.allocator import round_size
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category, Phase, Pool
from peakledger.traces.cuda_snapshot import parse_snapshot
from peakledger.traces.store import load_trace
from peakledger.traces.tracker import AllocationTracker

H200 = {"name": "NVIDIA H200 (stand-in)", "compute_capability": [9, 0], "total_memory": 150_754_820_096,
        "free_memory": 150_000_000_000, "profile": "H200-141GB", "torch": "2.11.0+cu128", "allocator_rules": "2.11",
        "alloc_conf": ""}


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- 1. bf16-mixed: the capture's program is the simulator's --------------------------------------------------

class TrackerMarks(cc.LoopMarks):
    """The loop's marks driving a CPU allocation tracker's phase, so `run_loop` itself is measured."""

    def __init__(self, tracker):
        super().__init__(gap=0.0)
        self.tracker = tracker

    def mark(self, phase, step=0, micro_batch=-1):
        super().mark(phase, step, micro_batch)
        if phase is not None:
            self.tracker.phase_state = (phase, step, micro_batch)


def measure_capture_program(scenario):
    """`build_program` + `run_loop` of the CUDA capture, on the CPU under the exact tracker."""
    torch.set_num_threads(1)
    model, optimizer, batches = cc.build_program(scenario, "cpu")
    tracker = AllocationTracker(model, None, known=tuple(t for b in batches for t in b))
    with tracker:  # what the capture finds live at record start: the masters and main grads are load too
        for m in getattr(optimizer, "masters", []):
            tracker.mark(m, Category.PARAMETER, name="master")
        for g in getattr(optimizer, "main_grads", None) or []:
            tracker.mark(g, Category.GRADIENT, name="main_grad")
        marks = TrackerMarks(tracker)
        cc.run_loop(model, optimizer, batches, scenario.setup, "cpu", marks)
    return tracker.log(), marks


@pytest.mark.parametrize("training", [
    {"precision": "bf16-mixed"},
    {"precision": "bf16-mixed", "fp32_grads": True, "grad_accum": 2},
    {"precision": "bf16-mixed", "optimizer_impl": "for-loop", "checkpointing": "full"},
    {"precision": "bf16"},
])
def test_the_capture_program_matches_the_simulation_byte_for_byte(training):
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 32, **training}, {"device": "cpu"})
    measured, _ = measure_capture_program(scenario)
    simulated = simulate(describe(scenario.model, scenario.setup, "cpu", all_steps=True))
    v = compare_logs(measured, simulated, name="tiny")
    assert v.overall.measured == v.overall.predicted
    assert v.first_step.measured == v.first_step.predicted and v.steady.measured == v.steady.predicted
    assert all(abs(p.predicted - p.measured) <= 8 for p in v.phases), [(p.label, p.error) for p in v.phases]


def test_bf16_mixed_keeps_fp32_masters_and_states_and_bf16_parameters():
    scenario = build_scenario({"preset": "tiny"}, {"precision": "bf16-mixed", "micro_batch": 2, "seq_len": 32}, {})
    model, optimizer, _ = cc.build_program(scenario, "cpu")
    assert isinstance(optimizer, cc.MasterWeights)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in optimizer.masters} == {torch.float32}
    assert len(optimizer.masters) == len(list(model.parameters()))
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])


def test_capture_bf16_mixed_without_cuda_gets_past_the_precision(capsys, tmp_path):
    code, _, err = run_cli(capsys, "capture", "--device-kind", "cuda", "--precision", "bf16-mixed",
                           "--output", tmp_path / "t.json")
    assert code == 2 and err.startswith("peakledger: error: device_kind:") and "needs a CUDA GPU" in err  # not 3


@pytest.mark.parametrize("flags, field", [(["--precision", "fp16-mixed"], "precision"),
                                          (["--precision", "fp16-autocast"], "precision"),
                                          (["--optimizer", "adam-8bit"], "optimizer"),
                                          (["--passes", "forward"], "passes")])
def test_capture_refuses_what_it_cannot_run_before_looking_for_cuda(capsys, tmp_path, flags, field):
    code, _, err = run_cli(capsys, "capture", "--device-kind", "cuda", *flags, "--output", tmp_path / "t.json")
    assert code == 2 and err.startswith(f"peakledger: error: {field}:") and len(err.strip().splitlines()) == 1


# -- 5. steps numbered from 1 by the loop's marks -------------------------------------------------------------

def test_the_loop_marks_number_steps_from_one_as_the_simulator_does():
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "grad_accum": 2}, {})
    _, marks = measure_capture_program(scenario)
    phases = [(ph.value if ph else "end", s, mb) for _, ph, s, mb in marks.marks]
    assert phases == [("forward", 1, 0), ("backward", 1, 0), ("forward", 1, 1), ("backward", 1, 1),
                      ("optimizer", 1, -1), ("zero_grad", 1, -1),
                      ("forward", 2, 0), ("backward", 2, 0), ("forward", 2, 1), ("backward", 2, 1),
                      ("optimizer", 2, -1), ("zero_grad", 2, -1), ("end", 0, -1)]


def _entry(action, addr, size, t_us):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t_us,
            "frames": [{"filename": "train.py", "line": 1, "name": "step"}]}


def test_label_steps_gives_each_event_the_step_and_phase_of_the_mark_before_it():
    marks = [(10.0, Phase.FORWARD, 1, 0), (20.0, Phase.BACKWARD, 1, 0), (30.0, Phase.OPTIMIZER, 1, -1),
             (40.0, Phase.ZERO_GRAD, 1, -1), (50.0, Phase.FORWARD, 2, 0), (60.0, None, 0, -1)]
    trace = [_entry("alloc", 4096, 512, 11_000_000), _entry("alloc", 8192, 1024, 21_000_000),
             _entry("free_requested", 8192, 1024, 31_000_000), _entry("free_completed", 8192, 1024, 31_000_001),
             _entry("alloc", 16384, 512, 51_000_000), _entry("alloc", 20480, 512, 61_000_000)]
    blocks = [{"address": a, "size": 512, "requested_size": 512, "state": "active_allocated"}
              for a in (0, 4096, 16384, 20480)]
    snap = {"segments": [{"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
                          "blocks": blocks}], "device_traces": [trace]}
    t = parse_snapshot(snap)
    assert {e.step for e in t.allocated.events} == {0}  # a snapshot alone knows no steps
    found = cc.label_steps(t, marks)
    got = [(e.op, e.phase.value, e.step, e.micro_batch_index) for e in t.allocated.events]
    assert got == [("pre-existing", "load", 0, -1), ("alloc", "forward", 1, 0), ("alloc", "backward", 1, 0),
                   ("free_completed", "optimizer", 1, -1), ("alloc", "forward", 2, 0), ("alloc", "forward", 2, 0)]
    assert found == {"by": "loop marks", "marks": 6, "outside": 1}  # the last alloc came after the end mark
    assert {e.step for e in t.reserved.events} == {0}  # the segment was there at record start: the load


# -- the GPU's profile and allocator rules --------------------------------------------------------------------

@pytest.mark.parametrize("cap, total, profile", [((9, 0), 150_754_820_096, "H200-141GB"),
                                                 ((9, 0), 85_520_809_984, "H100-80GB"),
                                                 ((8, 0), 85_899_345_920, "A100-80GB"),
                                                 ((8, 9), 24 << 30, "RTX-4090-24GB"), ((8, 9), 48 << 30, "L40S-48GB"),
                                                 ((7, 5), 16 << 30, "T4-16GB"), ((6, 1), 12 << 30, None)])
def test_gpu_profile_by_compute_capability_and_memory(cap, total, profile):
    assert cc.gpu_profile(cap, total) == profile


@pytest.mark.parametrize("version, rules", [("2.6.0+cu124", "2.6"), ("2.10.1", "2.6"), ("2.11.0", "2.11"),
                                            ("2.12.1", "2.11"), ("2.13.0+cu128", "2.13"), ("1.13", "2.6")])
def test_allocator_rules_of_the_torch_that_ran(version, rules):
    assert cc.allocator_rules(version) == rules


# -- 2. the guards: what the host really holds, the GPU against the prediction --------------------------------

LLAMA = ["--preset", "llama-3-8b", "--precision", "bf16", "--micro-batch", "1", "--seq-len", "4096",
         "--checkpointing", "full"]


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """A GPU that `cuda_device` reports, and a capture that stops where it would start running."""
    gpu = dict(H200)
    monkeypatch.setattr(cc, "cuda_device", lambda: gpu)

    def reached(scenario, path, max_entries=cc.MAX_ENTRIES, device=None):
        raise ConfigError("device_kind", f"stand-in: the capture of {scenario.name} would start here")

    monkeypatch.setattr(cc, "capture_cuda", reached)
    return gpu


def test_the_host_guard_counts_what_the_host_holds_not_a_cpu_run(capsys, tmp_path, monkeypatch, stand_in_gpu):
    monkeypatch.setattr("peakledger.inputs.real_run_limit", lambda: 48 << 30)  # a 96 GiB host
    code, _, err = run_cli(capsys, "capture", "--device-kind", "cuda", *LLAMA, "--output", tmp_path / "t.json")
    assert code == 2 and "stand-in: the capture of llama-3-8b would start here" in err  # not refused
    # as a CPU run (what the guard counted before) the same capture would have been refused
    from peakledger.cli import build_parser
    args = build_parser().parse_args(["capture", "--device-kind", "cuda", *LLAMA, "--output", "t.json"])
    with pytest.raises(ConfigError, match="host memory"):
        check_real_run(args, real_run_scenario(args))
    need = host_need(real_run_scenario(args), "H200-141GB", "2.11")
    assert abs(need.build - 4 * 8_030_261_248) < 1 << 20  # Llama 3 8B's parameters built in fp32 on the host
    assert need.host == need.build + (600 << 20) + CUDA_HOST_BYTES
    assert 60 << 30 < need.device < 141 * 10**9  # bf16 weights, grads, fp32 AdamW states: on the GPU


def test_the_host_guard_still_refuses_a_host_too_small_for_the_build(capsys, tmp_path, monkeypatch, stand_in_gpu):
    monkeypatch.setattr("peakledger.inputs.real_run_limit", lambda: 16 << 30)
    code, _, err = run_cli(capsys, "capture", "--device-kind", "cuda", *LLAMA, "--output", tmp_path / "t.json")
    assert code == 2 and err.startswith("peakledger: error: force:") and "built on the host in fp32" in err
    assert len(err.strip().splitlines()) == 1


def test_the_gpu_guard_holds_the_prediction_against_free_gpu_memory(capsys, tmp_path, monkeypatch, stand_in_gpu):
    monkeypatch.setattr("peakledger.inputs.real_run_limit", lambda: 1 << 40)
    stand_in_gpu["free_memory"] = 40 << 30
    argv = ["capture", "--device-kind", "cuda", *LLAMA, "--output", tmp_path / "t.json"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("peakledger: error: force:") and "NVIDIA H200 (stand-in) has 40" in err
    assert "H200-141GB profile, torch 2.11 allocator rules" in err
    code, _, err = run_cli(capsys, *argv, "--force")
    assert code == 2 and "would start here" in err


# -- 3, 4, 5: a whole capture, then validate --trace ----------------------------------------------------------

def _snapshot_of(log, marks: list) -> dict:
    """The CUDA snapshot a capture of `log`'s run would dump: its load live at record start (in the segment, not
    in the trace), every later device event at the time of the loop mark of its phase, step and micro-batch."""
    windows = {(ph, s, mb): t for t, ph, s, mb in marks if ph is not None}
    addr, entries, live, ticks = {}, [], {}, itertools.count(1)
    next_addr = 1 << 20
    for e in log.events:
        b = e.block
        if b.pool is not Pool.DEVICE or b.nbytes == 0:
            continue
        if b.id not in addr:
            addr[b.id] = next_addr
            next_addr += round_size(b.nbytes)
        if e.action is Action.ALLOC:
            live[b.id] = b
        else:
            live.pop(b.id)
        if e.phase is Phase.LOAD:
            continue
        t_us = int(windows[(e.phase, e.step, e.micro_batch_index)] * 1e6) + next(ticks)
        actions = ["alloc"] if e.action is Action.ALLOC else ["free_requested", "free_completed"]
        entries += [_entry(a, addr[b.id], b.nbytes, t_us) for a in actions]
    blocks = [{"address": addr[i], "size": round_size(b.nbytes), "requested_size": b.nbytes,
               "state": "active_allocated"} for i, b in live.items()]
    return {"segments": [{"device": 0, "address": 1 << 20, "total_size": next_addr - (1 << 20), "stream": 0,
                          "segment_type": "large", "blocks": blocks}], "device_traces": [entries]}


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """torch.cuda stood in for: the program runs on the CPU, the host clock ticks a second per mark, and the dump
    writes the snapshot of the simulated run on the GPU's profile (so a validation of it is exact)."""
    gpu = dict(H200)
    seen = {}
    monkeypatch.setattr(cc, "cuda_device", lambda: gpu)
    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(cc, "_now", lambda: float(next(clock)))
    monkeypatch.setattr(cc, "_pause", lambda s: None)
    build, loop = cc.build_program, cc.run_loop
    monkeypatch.setattr(cc, "build_program", lambda scenario, device="cuda": build(scenario, "cpu"))

    def run_loop(model, optimizer, batches, setup, device, marks):
        seen["marks"], seen["setup"] = marks, setup
        return loop(model, optimizer, batches, setup, "cpu", marks)

    monkeypatch.setattr(cc, "run_loop", run_loop)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)

    def dump(path):
        scenario = seen["scenario"]
        graph = describe(scenario.model, seen["setup"], gpu["profile"], torch_version=gpu["allocator_rules"],
                         all_steps=True)
        with open(path, "wb") as f:
            pickle.dump(_snapshot_of(simulate(graph), seen["marks"].marks), f)

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    check = cc.check_capturable

    def remember(scenario):
        seen["scenario"] = scenario
        return check(scenario)

    monkeypatch.setattr(cc, "check_capturable", remember)
    return gpu


def test_a_bf16_mixed_cuda_capture_runs_and_records_its_scenario_and_gpu(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    code, text, err = run_cli(capsys, "capture", "--device-kind", "cuda", "--precision", "bf16-mixed",
                              "--output", out)
    assert code == 0, err
    assert "on NVIDIA H200 (stand-in)" in text and "steps 1-2" in text
    log = load_trace(out).log
    meta = log.metadata
    assert meta.model_kind == "TransformerConfig" and meta.scenario == "tiny"
    assert meta.setup.precision.name == "bf16-mixed"
    assert meta.device_kind == "cuda" and meta.device_profile == "H200-141GB"
    assert meta.allocator_rules == "2.11" and meta.compute_capability == [9, 0]
    assert meta.step_labels == {"by": "loop marks", "marks": 9, "outside": 0}
    # 5: the first step is step 1, as the prediction's; the state at record start is the load, step 0
    loop = [e for e in log.events if e.op != "pre-existing"]
    assert loop[0].step == 1 and loop[0].phase is Phase.FORWARD
    assert {e.step for e in loop} == {1, 2}
    assert {e.step for e in log.events if e.op == "pre-existing"} == {0}
    assert {e.phase for e in loop} == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.ZERO_GRAD}


def test_validate_trace_of_a_cuda_capture_simulates_it_on_the_gpu_profile(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    assert run_cli(capsys, "capture", "--device-kind", "cuda", "--precision", "bf16-mixed", "--output", out)[0] == 0
    code, text, err = run_cli(capsys, "validate", "--trace", out, "--json", "--tolerance", "0")
    assert code == 0, err
    data = json.loads(text)
    assert "simulating on H200-141GB" in err and "allocator rules of torch 2.11" in err
    assert data["predicted_by"] == "simulator, H200-141GB profile, torch 2.11 allocator rules"
    assert data["measured_by"] == ("CUDA capture on NVIDIA H200 (stand-in) (cuda:0, compute capability 9.0, "
                                   "torch 2.11.0+cu128)")
    assert data["peak"]["error"] == 0 and data["first_step_peak"]["error"] == 0 and data["steady_peak"]
    assert "forward step 1" in data["phases"] and "optimizer step 2" in data["phases"]
    assert not any(label.endswith("step 0") and label != "load step 0" for label in data["phases"])
    assert all(p["error"] == 0 for p in data["phases"].values())
    assert data["unexplained"] == [] and data["host_peak"] is None  # sizes pair whatever the snapshot's categories
    reserved = load_trace(out).log.metadata.reserved_peak
    assert data["reserved_peak"]["measured"] == reserved and data["reserved_peak"]["predicted"] > 0
    # 4: the text names what the trace is, not a CPU run
    code, text, _ = run_cli(capsys, "validate", "--trace", out)
    title = text.splitlines()[0]
    assert code == 0 and "real torch run on CPU" not in text
    assert title == ("validate tiny: measured (CUDA capture on NVIDIA H200 (stand-in) (cuda:0, compute capability "
                     "9.0, torch 2.11.0+cu128)) vs predicted (simulator, H200-141GB profile, torch 2.11 allocator "
                     "rules)")
    assert "reserved (allocator)" in text


def test_validate_trace_flags_override_the_recorded_gpu_and_rules(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    assert run_cli(capsys, "capture", "--device-kind", "cuda", "--output", out)[0] == 0
    code, text, err = run_cli(capsys, "validate", "--trace", out, "--device", "H100-80GB", "--torch-version", "2.6",
                              "--json")
    data = json.loads(text)
    assert code == 0 and data["predicted_by"] == "simulator, H100-80GB profile, torch 2.6 allocator rules"
    assert "simulating on H100-80GB (--device); the trace ran on NVIDIA H200 (stand-in)" in err
    code, _, err = run_cli(capsys, "validate", "--trace", out, "--device", "cpu")
    assert code == 2 and err.startswith("peakledger: error: device:") and "CUDA trace" in err


def _edited_trace(tmp_path, out, **meta):
    data = json.loads(out.read_text())
    data["metadata"].update(meta)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    return edited


def test_validate_trace_of_a_gpu_without_a_profile_asks_for_one(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    assert run_cli(capsys, "capture", "--device-kind", "cuda", "--output", out)[0] == 0
    edited = _edited_trace(tmp_path, out, device_profile=None, gpu="NVIDIA L4", compute_capability=[8, 9])
    code, _, err = run_cli(capsys, "validate", "--trace", edited)
    assert code == 2 and err.startswith("peakledger: error: device:") and "NVIDIA L4 (compute capability 8.9)" in err
    assert len(err.strip().splitlines()) == 1
    assert run_cli(capsys, "validate", "--trace", edited, "--device", "A100-80GB")[0] == 0


def test_validate_trace_refuses_allocator_settings_it_cannot_model(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    assert run_cli(capsys, "capture", "--device-kind", "cuda", "--output", out)[0] == 0
    edited = _edited_trace(tmp_path, out, alloc_conf="no_such_knob:1")
    code, _, err = run_cli(capsys, "validate", "--trace", edited)
    assert code == 2 and err.startswith("peakledger: error: trace:") and "edited.json" in err
    assert len(err.strip().splitlines()) == 1


def test_a_raw_snapshot_is_titled_as_one_and_simulated_on_a_gpu(capsys, tmp_path, stand_in_cuda):
    out = tmp_path / "t.json"
    assert run_cli(capsys, "capture", "--device-kind", "cuda", "--output", out)[0] == 0
    raw = f"{out}.snapshot.pickle"
    code, text, err = run_cli(capsys, "validate", "--trace", raw, "--preset", "tiny", "--precision", "fp32",
                              "--device", "H200-141GB", "--torch-version", "2.11", "--micro-batch", "2",
                              "--seq-len", "32")
    assert code == 0, err
    assert text.splitlines()[0] == ("validate tiny: measured (CUDA memory snapshot (device 0)) vs predicted "
                                    "(simulator, H200-141GB profile, torch 2.11 allocator rules)")
    assert "has no step labels" in err


def test_a_cpu_trace_is_still_titled_a_cpu_run(tmp_path):
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "precision": "fp32"},
                              {"device": "cpu"})
    measured, _ = measure_capture_program(scenario)
    assert measured_description(measured) == "real torch run on CPU"
    v = compare_logs(measured, simulate(describe(scenario.model, scenario.setup, "cpu", all_steps=True)), "tiny")
    assert render_validation(v).splitlines()[0] == ("validate tiny: measured (real torch run on CPU) vs predicted "
                                                    "(simulator)")
    assert dataclasses.asdict(v)["reserved"] is None
