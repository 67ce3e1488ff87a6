"""CUDA snapshot loading (restricted unpickler, the state at record start, truncation, every device) and export to
torch's own viewer."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from peakledger import build_scenario, run
from peakledger.analysis.export import chrome_trace, to_snapshot, write_chrome_trace, write_snapshot
from peakledger.cli import main
from peakledger.simulator.events import Category
from peakledger.traces.cuda_snapshot import (
    SnapshotError,
    TruncatedTraceError,
    UnsafePickleError,
    load_snapshot,
    load_snapshot_devices,
    parse_snapshot,
    safe_loads,
)
from peakledger.traces.store import load_trace

GPU_TRUTH = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-truth" / "snapshots"
SNAPSHOTS = sorted(p.name for p in GPU_TRUTH.glob("*.pickle")) if GPU_TRUTH.is_dir() else []
needs_gpu_truth = pytest.mark.skipif(not GPU_TRUTH.is_dir(), reason="../shared/gpu-truth is not beside this checkout")


def entry(action, addr, size, t, **kw):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": [{"filename": "train.py", "line": 1, "name": "step"}], **kw}


def synthetic():
    trace = [entry("segment_alloc", 0, 2 << 20, 0), entry("alloc", 0, 1024, 1), entry("alloc", 1024, 4096, 2),
             entry("free_requested", 0, 1024, 3), entry("free_completed", 0, 1024, 4), entry("alloc", 8192, 512, 5),
             entry("oom", 0, 10 << 30, 6, device_free=1 << 20)]
    segments = [{"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
                 "blocks": [{"address": 1024, "size": 4096, "state": "active_allocated"},
                            {"address": 8192, "size": 512, "state": "active_allocated"}]}]
    return {"segments": segments, "device_traces": [trace]}


def test_synthetic_snapshot_keeps_allocated_and_reserved_apart(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(synthetic()))
    t = load_snapshot(path)
    assert not t.truncated and t.peak_bytes() == 4096 + 1024
    assert sum(e.delta for e in t.reserved.events) == 2 << 20
    (oom,) = t.allocated.ooms
    assert oom.event.block.nbytes == 10 << 30 and oom.live_bytes == 4096 + 512


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/peakledger-pwned",))


def test_restricted_unpickler_refuses_a_malicious_pickle(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": Evil()}))
    with pytest.raises(UnsafePickleError, match="system"):
        load_snapshot(path)
    assert not os.path.exists("/tmp/peakledger-pwned")


def test_a_trace_that_starts_mid_run_opens_with_the_state_at_record_start():
    snap = synthetic()
    snap["device_traces"][0] = snap["device_traces"][0][2:]  # recording began after the segment and block 0
    t = parse_snapshot(snap)
    assert not t.truncated and not t.problems
    first = t.allocated.events[0]
    assert first.op == "pre-existing" and first.block.name.startswith("pre-existing@0x0")
    assert first.block.nbytes == 1024 and first.block.category is Category.UNKNOWN
    assert (t.preexisting, t.preexisting_bytes, t.preexisting_segments, t.preexisting_reserved) == (1, 1024, 1, 2 << 20)
    assert t.reserved.events[0].op == "pre-existing" and t.reserved.events[0].block.nbytes == 2 << 20
    assert t.peak_bytes() == 1024 + 4096 and t.reserved_peak_bytes() == 2 << 20


def wrapped(snap, **kw):
    return {**snap, **kw}


@pytest.mark.parametrize("edit, reason", [
    # the file records the max_entries it was recorded with, and the trace is that long: the ring buffer wrapped
    (lambda s: wrapped(s, max_entries=len(s["device_traces"][0])), "max_entries"),
    # a free of a block that lies in no segment at that time
    (lambda s: wrapped(s, device_traces=[[entry("free_completed", 64 << 20, 1024, 0)] + s["device_traces"][0]]),
     "lies in no segment"),
    # an alloc of an address already live (allocated twice with no free between)
    (lambda s: wrapped(s, device_traces=[s["device_traces"][0][:2] + [entry("alloc", 0, 512, 1)]
                                         + s["device_traces"][0][2:]]), "no block is live there"),
    # a free of a block on top of another live block
    (lambda s: wrapped(s, device_traces=[s["device_traces"][0] + [entry("free_completed", 2048, 1024, 7)]]),
     "overlaps a block"),
    # a segment released that is still reserved afterwards with no segment_alloc between
    (lambda s: wrapped(s, device_traces=[s["device_traces"][0] + [entry("segment_free", 0, 2 << 20, 7)]]),
     "reserved again after it"),
])
def test_a_genuinely_truncated_trace_is_told_apart_and_its_peak_refused(edit, reason):
    t = parse_snapshot(edit(synthetic()))
    assert t.truncated and any(reason in p for p in t.problems), t.problems
    with pytest.raises(TruncatedTraceError, match="truncated"):
        t.peak_bytes()
    assert t.peak_bytes(allow_truncated=True) > 0


def test_a_two_device_snapshot_is_read_per_device(tmp_path, capsys):
    one = synthetic()
    one["device_traces"][0].pop()  # no oom entry: explain replays each device against the budget
    trace1 = [entry("segment_alloc", 1 << 30, 20 << 20, 0), entry("alloc", 1 << 30, 8 << 20, 1),
              entry("alloc", (1 << 30) + (8 << 20), 4 << 20, 2, stream=77)]
    seg1 = {"device": 1, "address": 1 << 30, "total_size": 20 << 20, "stream": 0, "segment_type": "large",
            "blocks": [{"address": 1 << 30, "size": 8 << 20, "state": "active_allocated"},
                       {"address": (1 << 30) + (8 << 20), "size": 4 << 20, "state": "active_allocated"}]}
    snap = {"segments": one["segments"] + [seg1], "device_traces": one["device_traces"] + [trace1]}
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(snap))
    d0, d1 = load_snapshot_devices(path)
    assert (d0.device, d1.device) == (0, 1) and not d0.truncated and not d1.truncated
    assert d0.peak_bytes() == 4096 + 1024 and d1.peak_bytes() == 12 << 20 and d1.reserved_peak_bytes() == 20 << 20
    assert {e.block.rank for e in d1.allocated.events} == {1}
    assert ([e.op for e in d1.allocated.events] == ["alloc", "alloc (stream 1)"]
            and d1.allocated.metadata.streams == [0, 77])
    assert load_snapshot(path, device=1).peak_bytes() == 12 << 20
    ids = [e.block.id for t in (d0, d1) for log in (t.allocated, t.reserved) for e in log.events
           if e.action.value == "alloc"]
    assert len(ids) == len(set(ids))
    trace = load_trace(path)
    assert ({e.block.rank for e in trace.log.events} == {0, 1}
            and {e.block.rank for e in trace.reserved.events} == {0, 1})
    assert main(["explain", "--trace", str(path), "--budget", "10MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moment"]["rank"] == 1 and out["moment"]["failed"]  # device 1 goes over 10 MiB, device 0 never does
    assert out["reserved_moment"]["rank"] == 1 and out["reserved_moment"]["segment_bytes"] == 20 << 20


def test_expandable_segments_map_and_unmap_in_the_reserved_view():
    A, MB = 1 << 32, 1 << 20
    trace = [entry("segment_map", A, 20 * MB, 0), entry("alloc", A, 30 * MB, 1),
             entry("segment_map", A + 20 * MB, 20 * MB, 2),
             entry("free_completed", A, 30 * MB, 3), entry("segment_unmap", A + 20 * MB, 20 * MB, 4)]
    snap = {"segments": [{"device": 0, "address": A, "total_size": 20 * MB, "stream": 0, "segment_type": "large",
                          "is_expandable": True, "blocks": [{"address": A, "size": 20 * MB, "state": "inactive"}]}],
            "device_traces": [trace]}
    t = parse_snapshot(snap)
    assert not t.truncated and t.preexisting_segments == 0
    assert t.reserved_peak_bytes() == 40 * MB and sum(e.delta for e in t.reserved.events) == 20 * MB


def test_garbage_and_wrong_shapes_are_clear_errors():
    with pytest.raises(SnapshotError):
        safe_loads(b"not a pickle")
    with pytest.raises(SnapshotError, match="segments"):
        parse_snapshot({"hello": 1})
    bad = synthetic()
    bad["device_traces"][0].append(entry("teleport", 0, 1, 9))
    with pytest.raises(SnapshotError, match="teleport"):
        parse_snapshot(bad)


@pytest.fixture(scope="module")
def report():
    return run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}))


def test_exported_snapshot_round_trips_to_the_same_peak(report, tmp_path):
    path = tmp_path / "sim.pickle"
    write_snapshot(report.log, str(path))
    t = load_snapshot(path)
    assert not t.truncated and t.peak_bytes() == report.peaks.overall.bytes


def test_torch_memory_viz_renders_the_exported_snapshot(report, tmp_path):
    from torch.cuda import _memory_viz
    snap = to_snapshot(report.log)
    html = _memory_viz.trace_plot(snap)
    assert "<html" in html.lower() or "<!doctype" in html.lower()
    lines = _memory_viz.segments(snap, format_flamegraph=lambda x: x)
    assert "transformer.wte.weight" in lines
    path = tmp_path / "sim.pickle"
    write_snapshot(report.log, str(path))
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "entries" in out


def test_chrome_trace_counters_end_at_the_live_state(report, tmp_path):
    trace = chrome_trace(report.log)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"].startswith("device")]
    assert max(sum(e["args"].values()) for e in counters) == report.peaks.overall.bytes
    path = tmp_path / "t.json"
    write_chrome_trace(report.log, str(path))
    assert json.loads(path.read_text())["traceEvents"]


def _file_figures(snap: dict) -> dict:
    """What the file says without any reconstruction: final live blocks / segments, and what the trace did."""
    trace = snap["device_traces"][0]
    live = [b for s in snap["segments"] for b in s["blocks"]
            if b["state"] in ("active_allocated", "active_pending_free")]
    count = {a: sum(1 for e in trace if e["action"] == a) for a in ("alloc", "free_completed", "segment_alloc",
                                                                    "segment_free")}
    size = {a: sum(e["size"] for e in trace if e["action"] == a) for a in count}
    return {"blocks": len(live) - count["alloc"] + count["free_completed"],
            "bytes": sum(b["requested_size"] for b in live) - size["alloc"] + size["free_completed"],
            "segments": len(snap["segments"]) - count["segment_alloc"] + count["segment_free"],
            "reserved": sum(s["total_size"] for s in snap["segments"]) - size["segment_alloc"] + size["segment_free"],
            "final_bytes": sum(b["requested_size"] for b in live),
            "final_reserved": sum(s["total_size"] for s in snap["segments"])}


@needs_gpu_truth
@pytest.mark.parametrize("name", SNAPSHOTS)
def test_every_shared_snapshot_loads_untruncated_from_its_state_at_record_start(name):
    snap = safe_loads((GPU_TRUTH / name).read_bytes())
    (t,) = load_snapshot_devices(GPU_TRUTH / name)
    assert not t.truncated and not t.problems, t.problems[:3]
    want = _file_figures(snap)
    assert (t.preexisting, t.preexisting_bytes) == (want["blocks"], want["bytes"])
    assert (t.preexisting_segments, t.preexisting_reserved) == (want["segments"], want["reserved"])
    # each view, replayed from its start state, ends at what the dump holds
    assert sum(e.delta for e in t.allocated.events) == want["final_bytes"]
    assert sum(e.delta for e in t.reserved.events) == want["final_reserved"]


@needs_gpu_truth
def test_the_start_state_of_a_run_that_opens_by_releasing_a_cache():
    # ctx128_fullstep_: the process ran other configurations before; the trace opens with 430 segment_free of
    # their cache, and the 2.7B model's parameters (fp32, 12.69 GiB) were allocated before recording
    name = "kkaitlyn111__memory_files--memory_ctx128_fullstep_.pickle"
    snap = safe_loads((GPU_TRUTH / name).read_bytes())
    trace = snap["device_traces"][0]
    opening = next(i for i, e in enumerate(trace) if e["action"] != "segment_free")
    assert opening == 430
    t = load_snapshot(GPU_TRUTH / name)
    want = _file_figures(snap)
    assert t.preexisting_bytes == want["bytes"] and 12.69 < t.preexisting_bytes / 2**30 < 12.73
    assert t.preexisting_reserved == want["reserved"]
    # the opening segment_frees release exactly segments of the start state, down to what the model holds
    released = sum(e["size"] for e in trace[:opening])
    after_opening = t.reserved.events[t.preexisting_segments + opening - 1]
    assert after_opening.op == "segment_free"
    assert sum(e.delta for e in t.reserved.events[:t.preexisting_segments + opening]) == want["reserved"] - released


@needs_gpu_truth
def test_explain_trace_names_the_reserved_moment_of_a_real_snapshot(capsys):
    name = "kkaitlyn111__memory_files--memory_ctx128_fullstep_.pickle"
    budget = 50 << 30
    snap = safe_loads((GPU_TRUTH / name).read_bytes())
    # from the file: reserved at record start, then the first segment_alloc that takes it over the budget
    reserved = _file_figures(snap)["reserved"]
    assert reserved <= budget
    for first in snap["device_traces"][0]:
        reserved += {"segment_alloc": first["size"], "segment_free": -first["size"]}.get(first["action"], 0)
        if reserved > budget:
            break
    assert first["action"] == "segment_alloc"
    assert main(["explain", "--trace", str(GPU_TRUTH / name), "--budget", str(budget), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["reserved_moment"]
    assert r["failed"] and not r["at_record_start"] and r["op"] == "segment_alloc"
    assert (r["reserved_after"], r["segment_bytes"]) == (reserved, first["size"])
    assert (r["reserved_before"] <= budget < r["reserved_after"]
            and r["segment"].startswith(f"segment@{first['addr']:#x}"))
    assert 0 < r["allocated_bytes"] <= r["reserved_before"]
    m = out["moment"]  # the allocated view: its first allocation over 50 GiB (the optimizer step's)
    assert m["failed"] and m["live_bytes"] + m["tensor_bytes"] > budget >= m["live_bytes"] and m["phase"] == "optimizer"
    assert m["reserved_bytes"] >= m["live_bytes"]
    assert main(["explain", "--trace", str(GPU_TRUTH / name), "--budget", "50GiB"]) == 0
    text = capsys.readouterr().out
    assert "RESERVED over the budget first at segment_alloc" in text and "OUT OF MEMORY first at alloc" in text
    assert f"segment@{first['addr']:#x}" in text
    # under what the cache held when recording began, the reserved moment is the state at record start
    assert main(["explain", "--trace", str(GPU_TRUTH / name), "--budget", "30GiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["reserved_moment"]
    figures = _file_figures(snap)
    assert r["failed"] and r["at_record_start"] and r["reserved_after"] == figures["reserved"]
    assert r["allocated_bytes"] == figures["bytes"]
