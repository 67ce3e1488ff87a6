"""CUDA snapshot loading (restricted unpickler, truncation) and export to torch's own viewer."""

import json
import os
import pickle
import subprocess
import sys

import pytest

from peakledger import build_scenario, run
from peakledger.analysis.export import chrome_trace, to_snapshot, write_chrome_trace, write_snapshot
from peakledger.traces.cuda_snapshot import (SnapshotError, TruncatedTraceError, UnsafePickleError, load_snapshot,
                                             parse_snapshot, safe_loads)


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


def test_truncated_trace_is_detected_and_its_peak_refused():
    snap = synthetic()
    snap["device_traces"][0] = snap["device_traces"][0][2:]  # the ring buffer lost the first entries
    t = parse_snapshot(snap)
    assert t.truncated and any("unknown block" in p for p in t.problems)
    with pytest.raises(TruncatedTraceError):
        t.peak_bytes()
    assert t.peak_bytes(allow_truncated=True) == 4096 + 512


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
    assert not t.truncated and t.peak_bytes() == report.peaks.peak.bytes


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
    assert max(sum(e["args"].values()) for e in counters) == report.peaks.peak.bytes
    path = tmp_path / "t.json"
    write_chrome_trace(report.log, str(path))
    assert json.loads(path.read_text())["traceEvents"]
