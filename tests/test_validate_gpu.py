"""bench/validate_gpu.py without a GPU: the no-GPU path (exit 0, its message, the section it writes), the matrix,
the dry run, and the comparison functions on synthetic snapshots and logs with the numbers worked out by hand
(plus one real shared snapshot of ../shared/gpu-truth against its prediction, where that folder is present)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
import sys
from pathlib import Path

import pytest

from peakledger import api
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Action, Block, Category, Event, EventLog, Phase, Stream
from peakledger.simulator.run_metadata import RunMetadata
from peakledger.traces.cuda_snapshot import load_snapshot, parse_snapshot

BENCH = Path(__file__).resolve().parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("validate_gpu", BENCH / "validate_gpu.py")
vg = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("validate_gpu", vg)  # dataclasses look their module up while the file runs
_spec.loader.exec_module(vg)

from gpu_snapshots import measured_peaks, read_snapshot  # noqa: E402  (bench/, on the path above)

MiB = 1 << 20
GPU_TRUTH = Path(__file__).resolve().parents[2] / "shared" / "gpu-truth" / "snapshots"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(vg, "cuda_device", lambda: None)


# -- the no-GPU path -----------------------------------------------------------------------------------------

def test_no_gpu_prints_the_message_and_exits_0(no_gpu, capsys, tmp_path):
    md = tmp_path / "VALIDATION.md"
    assert vg.main(["--validation-md", str(md)]) == 0
    assert capsys.readouterr().out == vg.NO_GPU + "\n"
    assert vg.NO_GPU == "no CUDA GPU on this machine: bench/validate_gpu.py records nothing here"
    assert not md.exists()  # nothing written without --write


def test_no_gpu_json(no_gpu, capsys):
    assert vg.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"gpu": None, "message": vg.NO_GPU, "runs": len(vg.all_configs()), "written": False}


def test_no_gpu_write_says_not_run_and_keeps_other_sections(no_gpu, capsys, tmp_path):
    md = tmp_path / "VALIDATION.md"
    md.write_text("# Validation matrix\n\nintro\n\n## Other section\n\nkept text\n")
    assert vg.main(["--write", "--validation-md", str(md)]) == 0
    assert capsys.readouterr().out.startswith(vg.NO_GPU + "; wrote 'GPU validation")
    text = md.read_text()
    assert text.startswith("# Validation matrix\n\nintro\n\n## Other section\n\nkept text\n")
    section = text[text.index(vg.SECTION):]
    assert "Not run on a GPU yet" in section and "python bench/validate_gpu.py --write" in section
    assert "--dry-run" in section and "--from-snapshots traces/data/gpu" in section
    assert f"{len(vg.all_configs())} runs" in section and vg.RESULTS_MARK not in section
    assert vg.main(["--write", "--validation-md", str(md)]) == 0  # deterministic: a second run changes nothing
    assert md.read_text() == text


def test_no_gpu_write_keeps_recorded_results(no_gpu, capsys, tmp_path):
    md = tmp_path / "VALIDATION.md"
    recorded = f"# V\n\n{vg.SECTION}\n\n{vg.RESULTS_MARK}NVIDIA H100 80GB HBM3 ...\n\n## Next\n\nx\n"
    md.write_text(recorded)
    assert vg.main(["--write", "--validation-md", str(md)]) == 0
    assert "kept the results already in" in capsys.readouterr().out
    assert md.read_text() == recorded


# -- the matrix and the dry run ------------------------------------------------------------------------------

def test_matrix():
    configs = vg.all_configs()
    assert len(configs) == 68
    assert len({c.label for c in configs}) == len({c.slug for c in configs}) == 68
    assert {c.model for c in configs} == {"tiny", "tiny-llama", "tiny-mlp", "cs336-tiny", "cs336-small"}
    assert {c.precision for c in configs} == {"fp32", "bf16-autocast", "bf16"}
    assert {c.impl for c in configs} == {"foreach", "for-loop"}
    assert {c.checkpointing for c in configs} == {"none", "full"}
    assert {c.passes for c in configs} == {"train", "forward"}
    c = vg.GpuConfig("tiny", "bf16", "for-loop", "full", attention="eager")
    assert c.label == "tiny, eager, bf16, adamw (for-loop), ckpt=full, B=4 T=64"
    assert c.slug == "tiny-eager-bf16-for-loop-ckpt-full-b4t64"
    sc = c.scenario("A100-80GB", "2.11")
    assert (sc.device, sc.torch_version, sc.setup.batch.steps) == ("A100-80GB", "2.11", 2)
    assert sc.setup.optimizer.impl == "for-loop" and sc.setup.checkpointing.policy == "full"
    mlp = vg.GpuConfig("tiny-mlp", "fp32", passes="forward", micro_batch=32, seq_len=None)
    assert mlp.scenario().setup.batch.passes == "forward" and mlp.steps == 1
    assert [c.label for c in vg.select(configs, ["cs336-small, fp32, forward"])] == [
        "cs336-small, fp32, forward only, ckpt=none, B=4 T=128"]


def test_allocator_rules_and_profiles():
    assert vg.allocator_rules("2.13.0+cu128") == "2.13"  # modelled: its own rules
    assert vg.allocator_rules("2.12.1") == "2.11"  # not modelled: the newest modelled not newer
    assert vg.allocator_rules("2.11.0") == "2.11"
    assert vg.allocator_rules("2.10.1") == "2.6"
    assert vg.allocator_rules("2.4.0") == "2.6"  # older than any modelled: the oldest rules
    assert vg.PROFILES == {(9, 0): "H100-80GB", (8, 0): "A100-80GB"}


def test_dry_run_lists_runs_with_predicted_sizes(no_gpu, capsys):
    assert vg.main(["--dry-run", "--json", "--only", "tiny-mlp, fp32, forward only"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] and out["device"] is None and len(out["runs"]) == 1
    run = out["runs"][0]
    assert run["snapshot"] == "tiny-mlp-fp32-fwd-ckpt-none-b32.pickle.gz" and run["profile"] == "H100-80GB"
    assert run["predicted"]["reserved"] >= run["predicted"]["allocated"] > 0
    assert run["max_entries"] >= 100_000 and run["trace_entries"] > 0


# -- the comparison functions, by hand -----------------------------------------------------------------------

P = vg.AllocPoint


def test_align_by_size():
    # 512 (1st) -> predicted 1, 1024 -> 0, 512 (2nd) -> 3; 2048 has no twin; predicted 4096 and the third 512 unpaired
    assert vg.align_by_size([512, 1024, 512, 2048], [1024, 512, 4096, 512, 512]) == [(0, 1), (1, 0), (2, 3)]
    assert vg.align_by_size([], [1, 2]) == [] and vg.align_by_size([7, 7], [7]) == [(0, 0)]


def test_compare_events():
    measured = [P(512, 512, 2 * MiB), P(1024, 1536, 2 * MiB), P(512, 2048, 2 * MiB), P(2048, 4096, 2 * MiB)]
    predicted = [P(1024, 1024, 2 * MiB), P(512, 1536, 2 * MiB), P(4096, 5632, 4 * MiB), P(512, 6144, 4 * MiB),
                 P(512, 6656, 4 * MiB)]
    out = vg.compare_events(measured, predicted)
    assert (out["measured_allocs"], out["predicted_allocs"], out["paired"], out["compared"]) == (4, 5, 3, 3)
    # pairs (0, 1), (1, 0), (2, 3): reserved gaps 0, 0, +2 MiB; allocated gaps +1024, -512, +4096
    r = out["reserved"]
    assert (r["equal"], r["within_2pct"], r["max_abs_diff"]) == (2, 2, 2 * MiB)
    assert r["mean_abs_diff"] == pytest.approx(2 * MiB / 3)
    assert r["worst"] == {"measured_alloc": 2, "predicted_alloc": 3, "size": 512, "measured": 2 * MiB,
                          "predicted": 4 * MiB}
    a = out["allocated"]
    assert (a["equal"], a["within_2pct"], a["max_abs_diff"]) == (0, 0, 4096)
    assert a["mean_abs_diff"] == pytest.approx((1024 + 512 + 4096) / 3)
    # a block live at record start counts for the pairing but is not compared (when it came is unknown)
    measured[0] = P(512, 512, 2 * MiB, timed=False)
    out = vg.compare_events(measured, predicted)
    assert (out["paired"], out["compared"], out["reserved"]["equal"]) == (3, 2, 1)
    assert vg.compare_events([], [])["reserved"] == {"equal": 0, "within_2pct": 0, "mean_abs_diff": 0.0,
                                                     "max_abs_diff": 0, "worst": None}


def test_compare_segments():
    out = vg.compare_segments([2 * MiB, 2 * MiB, 20 * MiB, 32 * MiB], [2 * MiB, 20 * MiB, 20 * MiB, 32 * MiB, 64 * MiB])
    assert out == {"measured": 4, "predicted": 5, "same": 3, "measured_bytes": 56 * MiB, "predicted_bytes": 138 * MiB,
                   "only_measured": [2 * MiB], "only_measured_count": 1, "only_predicted": [64 * MiB, 20 * MiB],
                   "only_predicted_count": 2}


def test_peak_errors():
    assert vg.peak_errors({"allocated": 100, "reserved": 200}, {"allocated": 101, "reserved": 190}) == \
        pytest.approx({"allocated": 0.01, "reserved": -0.05})
    assert vg.peak_errors({"allocated": 0, "reserved": 1}, {"allocated": 5, "reserved": 1})["allocated"] is None


# a synthetic snapshot: a 2 MiB small segment holding a 1000 B and a 600 B block (each 1024 B once rounded), the
# 1000 B one freed, then a 20 MiB large segment for a 3 MiB block. With `before`: a 2 MiB segment released by an
# opening empty_cache() and another holding a 512 B block, both from before the recording.
SEG1, SEG2, OLD, KEPT = 0x10000000, 0x20000000, 0x30000000, 0x40000000


def entry(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def synthetic_snapshot(before: bool = False) -> dict:
    trace = [entry("segment_free", OLD, 2 * MiB, 0)] if before else []
    trace += [entry("segment_alloc", SEG1, 2 * MiB, 1), entry("alloc", SEG1, 1000, 2),
              entry("alloc", SEG1 + 1024, 600, 3), entry("free_requested", SEG1, 1000, 4),
              entry("free_completed", SEG1, 1000, 4), entry("segment_alloc", SEG2, 20 * MiB, 5),
              entry("alloc", SEG2, 3 * MiB, 6)]
    segments = [
        {"device": 0, "address": SEG1, "total_size": 2 * MiB, "stream": 0, "segment_type": "small", "blocks": [
            {"address": SEG1, "size": 1024, "requested_size": 1000, "state": "inactive"},
            {"address": SEG1 + 1024, "size": 1024, "requested_size": 600, "state": "active_allocated"},
            {"address": SEG1 + 2048, "size": 2 * MiB - 2048, "requested_size": 0, "state": "inactive"}]},
        {"device": 0, "address": SEG2, "total_size": 20 * MiB, "stream": 0, "segment_type": "large", "blocks": [
            {"address": SEG2, "size": 3 * MiB, "requested_size": 3 * MiB, "state": "active_allocated"},
            {"address": SEG2 + 3 * MiB, "size": 17 * MiB, "requested_size": 0, "state": "inactive"}]}]
    if before:
        segments.append({"device": 0, "address": KEPT, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
                         "blocks": [{"address": KEPT, "size": 512, "requested_size": 512, "state": "active_allocated"},
                                    {"address": KEPT + 512, "size": 2 * MiB - 512, "requested_size": 0,
                                     "state": "inactive"}]})
    return {"segments": segments, "device_traces": [trace]}


def test_measured_points_and_peaks():
    trace = parse_snapshot(synthetic_snapshot())
    assert not trace.truncated
    points, segments = vg.measured_points(trace)
    assert points == [P(1000, 1000, 2 * MiB), P(600, 1600, 2 * MiB), P(3 * MiB, 600 + 3 * MiB, 22 * MiB)]
    assert segments == [2 * MiB, 20 * MiB]
    assert measured_peaks(trace) == {"allocated": 600 + 3 * MiB, "reserved": 22 * MiB}


def test_measured_points_with_state_at_record_start():
    trace = parse_snapshot(synthetic_snapshot(before=True))
    assert not trace.truncated and trace.preexisting_bytes == 512 and trace.preexisting_reserved == 4 * MiB
    points, segments = vg.measured_points(trace)
    # the 512 B block of before: reserved then both old segments (4 MiB), untimed; the trace's own allocations
    # come after the empty_cache() released one of them
    assert points == [P(512, 512, 4 * MiB, timed=False), P(1000, 1512, 4 * MiB), P(600, 2112, 4 * MiB),
                      P(3 * MiB, 1112 + 3 * MiB, 24 * MiB)]
    assert segments == [2 * MiB, 2 * MiB, 20 * MiB]  # the segment the opening empty_cache() released is not the run's
    assert measured_peaks(trace) == {"allocated": 1112 + 3 * MiB, "reserved": 24 * MiB}


def simulated_log(device: str = "H100-80GB") -> EventLog:
    """The synthetic snapshot's program as a simulated log: 1000 B and 600 B allocated, the first freed, 3 MiB."""
    blocks = [Block(i, n, Category.ACTIVATION, f"t{i}", "uint8") for i, n in ((1, 1000), (2, 600), (3, 3 * MiB))]
    steps = [(Action.ALLOC, 0), (Action.ALLOC, 1), (Action.FREE, 0), (Action.ALLOC, 2)]
    events = [Event(k, float(k), action, blocks[b], Phase.FORWARD, 1, 0, Stream.COMPUTE, "op")
              for k, (action, b) in enumerate(steps)]
    return EventLog(events, "simulator", RunMetadata(device=device))


def test_predicted_points():
    points, segments, dm = vg.predicted_points(simulated_log())
    # 1000 B and 600 B: 1024 B blocks in one 2 MiB small-pool segment; 3 MiB: a 20 MiB large segment (1-10 MiB)
    assert points == [P(1000, 1000, 2 * MiB), P(600, 1600, 2 * MiB), P(3 * MiB, 600 + 3 * MiB, 22 * MiB)]
    assert segments == [2 * MiB, 20 * MiB] and dm.reserved_peak.reserved == 22 * MiB
    assert vg.predicted_points(simulated_log("cpu")) == ([], [], None)
    events = vg.compare_events(vg.measured_points(parse_snapshot(synthetic_snapshot()))[0], points)
    assert (events["compared"], events["reserved"]["equal"], events["allocated"]["equal"]) == (3, 3, 3)


def test_from_snapshots_rereads_recorded_runs(no_gpu, capsys, tmp_path):
    """A folder as a GPU run leaves it (gzip'd snapshot + manifest.json), compared again without a GPU."""
    config = vg.GpuConfig("tiny-mlp", "fp32", passes="forward", micro_batch=32, seq_len=None)
    (tmp_path / "run.pickle.gz").write_bytes(gzip.compress(pickle.dumps(synthetic_snapshot()), mtime=0))
    device = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0], "profile": "H100-80GB",
              "torch": "2.13.0+cu128", "cuda": "12.8", "allocator_rules": "2.11"}
    manifest = {"format": "peakledger-gpu-validation", "version": 1, "device": device,
                "runs": [{"config": vg.dataclasses.asdict(config), "snapshot": "run.pickle.gz", "start_reserved": 0}]}
    (tmp_path / vg.MANIFEST).write_text(json.dumps(manifest))
    assert read_snapshot(tmp_path / "run.pickle.gz").allocated.metadata.entries == 7
    md = tmp_path / "VALIDATION.md"
    assert vg.main(["--from-snapshots", str(tmp_path), "--json", "--write", "--validation-md", str(md)]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["runs"][0]
    assert row["label"] == config.label and row["measured"] == {"allocated": 600 + 3 * MiB, "reserved": 22 * MiB}
    report = api.run(config.scenario("H100-80GB", "2.11"))
    assert row["predicted"] == {"allocated": report.peaks.overall.bytes, "reserved": report.gpu.reserved_peak.reserved}
    assert row["events"]["measured_allocs"] == 3 and row["segments"]["measured"] == 2
    section = md.read_text()
    assert f"{vg.RESULTS_MARK}NVIDIA H100 80GB HBM3 (compute capability 9.0, device profile H100-80GB)" in section
    assert f"| {config.label} | 3 / " in section and out["summary"] in section


@pytest.mark.skipif(not GPU_TRUTH.is_dir(), reason="../shared/gpu-truth is not beside this checkout")
def test_shared_snapshot_against_its_prediction():
    """The shared CS336 2.7B forward at ctx 128 (fp32) against its prediction (as bench/validate_gpu_truth.py
    builds it): peaks equal; reserved equal after every paired allocation but one (the 32 MiB cuBLAS workspace,
    live at record start in the snapshot, allocated at the first GEMM in the simulation); the same 516 segments."""
    path = GPU_TRUTH / "kkaitlyn111__memory_files--memory_ctx128_forward_.pickle"
    module = str(BENCH.parent / "examples" / "modules" / "cs336_lm.py") + ":factory"
    scenario = build_scenario({"module": module}, {"micro_batch": 4, "seq_len": 128, "precision": "fp32",
                                                   "optimizer": "adamw", "optimizer_impl": "for-loop", "steps": 1,
                                                   "passes": "forward"}, {"device": "H100-80GB"})
    out = vg.compare_run(load_snapshot(path), api.run(scenario))
    assert out["error"] == {"allocated": 0.0, "reserved": 0.0}
    ev = out["events"]
    assert (ev["measured_allocs"], ev["predicted_allocs"], ev["paired"]) == (2382, 2382, 2382)
    assert (ev["compared"], ev["reserved"]["equal"], ev["reserved"]["max_abs_diff"]) == (2058, 2057, 32 * MiB)
    assert out["segments"]["same"] == out["segments"]["measured"] == out["segments"]["predicted"] == 516


@pytest.mark.parametrize("config", [
    vg.GpuConfig("tiny", "bf16-autocast", "for-loop", "full", attention="eager", micro_batch=2, seq_len=16),
    vg.GpuConfig("tiny-mlp", "bf16", passes="forward", micro_batch=4, seq_len=None),
    vg.GpuConfig("cs336-tiny", "fp32", "foreach", "full", micro_batch=2, seq_len=16),
    vg.GpuConfig("cs336-tiny", "bf16-autocast", passes="forward", micro_batch=2, seq_len=16),
], ids=lambda c: c.slug)
def test_the_recorded_loop_runs_on_the_cpu(config):
    """The GPU path's model building and loop (everything but the recording), on the CPU: presets moved, traced
    models built on the device, forward-only passes through the module's own forward (no loss)."""
    import torch

    scenario = config.scenario()
    model, optimizer, batches, traced = vg.build_on(scenario, "cpu")
    assert traced == config.model.startswith("cs336") and (optimizer is None) == (config.passes == "forward")
    before = [p.detach().clone() for p in model.parameters()]
    vg.run_loop(model, optimizer, batches, scenario.setup, traced, "cpu")
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert changed == (config.passes == "train")  # trained, or only run forward
    if config.passes == "train":
        assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True) ended the step


def test_gpu_path_with_a_stand_in_device(monkeypatch, capsys, tmp_path):
    """The GPU path end to end, with torch's recording calls stood in for (the dump writes the synthetic snapshot)
    and the model run on the CPU: prediction, recording arguments, gzip'd snapshot, manifest, comparison, section."""
    import torch

    device = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0], "profile": "H100-80GB",
              "torch": "2.13.0+cu128", "cuda": "12.8", "allocator_rules": "2.11"}
    calls = []
    monkeypatch.setattr(vg, "cuda_device", lambda: device)
    monkeypatch.setattr(vg, "clean_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: Path(path).write_bytes(pickle.dumps(synthetic_snapshot())))
    build_on, run_loop = vg.build_on, vg.run_loop
    monkeypatch.setattr(vg, "build_on", lambda scenario, _: build_on(scenario, "cpu"))
    monkeypatch.setattr(vg, "run_loop", lambda *args: run_loop(*args[:-1], "cpu"))
    md, out_dir = tmp_path / "VALIDATION.md", tmp_path / "gpu"
    only = ["tiny-mlp, fp32, forward only", "tiny-mlp, bf16, forward only"]
    argv = ["--output-dir", str(out_dir), "--write", "--validation-md", str(md), "--json"]
    assert vg.main(argv + ["--only", only[0], "--only", only[1]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["runs"]] == [
        "tiny-mlp, fp32, forward only, ckpt=none, B=32", "tiny-mlp, bf16, forward only, ckpt=none, B=32"]
    assert calls[0] == {"max_entries": 100_000, "context": "alloc", "stacks": "python", "clear_history": True}
    assert calls[1] == {"enabled": None} and len(calls) == 4
    row = out["runs"][0]
    assert row["measured"] == {"allocated": 600 + 3 * MiB, "reserved": 22 * MiB} and row["start_reserved"] == 0
    assert row["pickle_bytes"] == len(pickle.dumps(synthetic_snapshot()))
    assert gzip.decompress((out_dir / row["snapshot"]).read_bytes()) == pickle.dumps(synthetic_snapshot())
    manifest = json.loads((out_dir / vg.MANIFEST).read_text())
    assert manifest["device"] == device and [r["snapshot"] for r in manifest["runs"]] == [
        "tiny-mlp-fp32-fwd-ckpt-none-b32.pickle.gz", "tiny-mlp-bf16-fwd-ckpt-none-b32.pickle.gz"]
    assert (sorted(p.name for p in out_dir.iterdir())
            == sorted([vg.MANIFEST] + [r["snapshot"] for r in manifest["runs"]]))
    section = md.read_text()
    assert f"{vg.RESULTS_MARK}NVIDIA H100 80GB HBM3" in section and "snapshots in " in section
    # a later run of one config replaces its own entry and keeps the other's; past the time limit nothing starts
    assert vg.main(argv + ["--only", only[1], "--limit-seconds", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["skipped"] == "--limit-seconds 0 reached"
    assert vg.main(argv + ["--only", only[1]]) == 0
    capsys.readouterr()
    assert [r["snapshot"] for r in json.loads((out_dir / vg.MANIFEST).read_text())["runs"]] == [
        "tiny-mlp-fp32-fwd-ckpt-none-b32.pickle.gz", "tiny-mlp-bf16-fwd-ckpt-none-b32.pickle.gz"]
