"""Exports that torch's and Perfetto's own tools take (analysis/export.py): the CUDA snapshot is the modelled caching
allocator's view (segments tiled by their blocks, the allocator's own trace), read by `python -m
torch.cuda._memory_viz` and by peakledger's own snapshot replay; the Chrome trace has step, phase and op slices."""

from __future__ import annotations

import json
import pickle
import pickletools
import re
import subprocess
import sys

import pytest

from peakledger import api, build_scenario
from peakledger.analysis.allocator_replay import replay_entries
from peakledger.analysis.device import gpu_memory
from peakledger.analysis.export import chrome_trace, to_snapshot, write_chrome_trace, write_snapshot
from peakledger.analysis.export_chrome import FROM_GRAPH, phase_label
from peakledger.cli import main
from peakledger.simulator.allocator import K_SMALL_BUFFER, round_size
from peakledger.simulator.events import Action, Pool
from peakledger.traces.cuda_snapshot import load_snapshot

TINY = {"micro_batch": 2, "seq_len": 16}
GPU = {"device": "H100-80GB"}
# two ranks (FSDP2: a communication stream), a checkpoint load at the start and a save after every step with
# torch.cuda.empty_cache() before it (segment_free events)
BUSY = ({**TINY, "world_size": 2, "dp_engine": "fsdp2", "checkpoint_every": 1, "save_mode": "full-rank0",
         "load_mode": "map-to-device"}, {**GPU, "empty_cache_before_save": True})
CASES = {"plain": (TINY, GPU), "busy": BUSY, "expandable": (TINY, {**GPU, "alloc_conf": "expandable_segments:True"})}
# the pickle opcodes torch/utils/viz/MemoryViz.js's own unpickler reads (pytorch.org/memory_viz, trace_plot's html)
MEMORY_VIZ_OPCODES = {"PROTO", "FRAME", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
                      "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "LONG1", "LONG_BINGET", "MARK",
                      "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
                      "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT"}


def _run(training: dict, run: dict, budget: int | None = None, stop: bool = False):
    sc = build_scenario({"preset": "tiny"}, training, run)
    graph = api.op_graph(sc, budget)
    return graph, api.run(sc, budget=budget, stop_on_oom=stop, graph=graph)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    graph, report = _run(*CASES[request.param])
    return request.param, graph, report, to_snapshot(report.log)


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """`peakledger simulate --export-snapshot --export-chrome` of the tiny GPT on an H100 profile."""
    d = tmp_path_factory.mktemp("exports")
    snap, chrome = d / "sim.pickle", d / "sim.json"
    assert main(["simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--device", "H100-80GB",
                 "--export-snapshot", str(snap), "--export-chrome", str(chrome)]) == 0
    return d, snap, chrome


def _memory_viz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args], capture_output=True, text=True,
                          timeout=300)


# --- the snapshot, through torch's own tools

def test_torch_memory_viz_stats_trace_plot_and_segment_plot_take_the_export(cli_files):
    d, snap, _ = cli_files
    data = pickle.loads(snap.read_bytes())
    stats = _memory_viz("stats", str(snap))
    assert stats.returncode == 0, stats.stderr
    assert f"segments: {len(data['segments'])}\n" in stats.stdout and "total_reserved:" in stats.stdout
    for tool in ("trace_plot", "segment_plot"):
        out = d / f"{tool}.html"
        done = _memory_viz(tool, str(snap), "-o", str(out))
        assert done.returncode == 0, done.stderr
        assert "snapshot.pickle" in out.read_text() and "add_local_files" in out.read_text()
    from torch.cuda import _memory_viz as viz  # its `trace` printout, in process (one torch start less)
    trace = viz.trace(data)
    assert "= cudaMalloc(" in trace and "free completed for" in trace


def test_segments_are_tiled_exactly_by_their_blocks(case):
    name, _, _, snap = case
    assert snap["segments"]
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr and b["size"] > 0  # MemoryViz places block i at address + sizes before it
            assert b["state"] in ("active_allocated", "inactive")
            if b["state"] == "active_allocated":
                assert 0 < b["requested_size"] <= b["size"] and b["frames"]
            else:
                assert b["requested_size"] == 0
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        active = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        assert seg["allocated_size"] == seg["active_size"] == sum(b["size"] for b in active)
        assert seg["requested_size"] == sum(b["requested_size"] for b in active)
        assert seg["is_expandable"] == (name == "expandable")
        if not seg["is_expandable"]:  # small-pool segments are kSmallBuffer; large ones never are
            assert (seg["segment_type"] == "small") == (seg["total_size"] == K_SMALL_BUFFER)


def _replay_trace(trace: list[dict]) -> dict:
    """Reserved and allocated (requested bytes) over a device trace, as torch's tools add them up."""
    reserved = allocated = peak_reserved = peak_allocated = 0
    counts = {"segment_alloc": 0, "segment_free": 0, "segment_map": 0, "segment_unmap": 0, "oom": 0}
    for e in trace:
        a = e["action"]
        if a in counts:
            counts[a] += 1
        if a in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif a in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        elif a == "alloc":
            allocated += e["size"]
        elif a == "free_completed":
            allocated -= e["size"]
        peak_reserved, peak_allocated = max(peak_reserved, reserved), max(peak_allocated, allocated)
    return {"reserved": reserved, "allocated": allocated, "peak_reserved": peak_reserved,
            "peak_allocated": peak_allocated, **counts}


def test_snapshot_figures_are_the_allocator_models(case):
    """Per rank: the trace's and the final segments' figures are gpu_memory's (analysis/device.py)."""
    name, graph, report, snap = case
    ranks = sorted({e.block.rank for e in report.log.events})
    assert len(snap["device_traces"]) == max(ranks) + 1 and (len(ranks) == 2) == (name == "busy")
    for rank in ranks:
        dm = gpu_memory(report.log, rank, series=True)
        got = _replay_trace(snap["device_traces"][rank])
        segs = [s for s in snap["segments"] if s["device"] == rank]
        end_time, end_allocated, end_reserved = dm.series[-1]
        assert got["peak_reserved"] == dm.reserved_peak.reserved
        assert got["reserved"] == sum(s["total_size"] for s in segs) == end_reserved
        assert got["allocated"] == sum(s["requested_size"] for s in segs) == end_allocated
        assert got["peak_allocated"] == dm.at_allocated_peak.allocated
        assert got["segment_alloc"] + got["segment_map"] == dm.segment_allocs > 0
        assert got["segment_free"] + got["segment_unmap"] == dm.segment_frees
        assert (dm.segment_frees > 0) == (name in ("busy",)) and got["oom"] == 0
        live = sum(e.delta for e in report.log.events if e.block.rank == rank and e.block.pool is Pool.DEVICE)
        assert end_allocated == live


def test_peakledgers_own_replay_reads_the_export_back_exactly(case, tmp_path):
    """The snapshot replay (analysis/allocator_replay.py) rebuilds an empty start state, predicts every segment event
    and ends on the same layout; the snapshot reader finds it whole, with the run's peak."""
    name, _, report, snap = case
    for rank, trace in enumerate(snap["device_traces"]):
        if not trace or name == "expandable":  # (the replay does not take expandable segments)
            continue
        r = replay_entries(snap, rank)
        assert r["start_segments"] == r["start_blocks"] == 0
        assert r["segments_measured"] == r["segments_predicted"] == r["segments_matched"]
        assert r["reserved_peak"]["measured"] == r["reserved_peak"]["predicted"]
        assert r["final_layout_matches"] and r["reserved_exact_fraction"] == 1.0 and not r["ooms"]
    path = tmp_path / "s.pickle"
    write_snapshot(report.log, str(path))
    t = load_snapshot(path, report.peaks.rank)
    assert not t.truncated and t.peak_bytes() == report.peaks.overall.bytes


def test_memory_viz_js_can_read_the_pickle(cli_files):
    """What pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js) needs: its unpickler's opcodes, numbers it holds
    exactly, frames on every entry, a device on every segment, and 'unknown' among the categories when there are
    any (its annotate_snapshot fails without it)."""
    _, snap, _ = cli_files
    raw = snap.read_bytes()
    used = {op.name for op, _, _ in pickletools.genops(raw)}
    assert used <= MEMORY_VIZ_OPCODES, used - MEMORY_VIZ_OPCODES
    data = pickle.loads(raw)
    entries = [e for t in data["device_traces"] for e in t]
    assert all(isinstance(e["frames"], list) and e.get("addr", 0) < 2 ** 53 for e in entries)
    assert all(s["device"] == 0 and s["address"] + s["total_size"] < 2 ** 53 for s in data["segments"])
    categories = {e["category"] for e in entries if "category" in e}
    assert "unknown" in categories and "parameter" in categories
    assert all(e["category"] == "unknown" for e in entries if e["action"].startswith("segment"))


def test_an_oom_is_in_the_trace_where_the_allocator_fails():
    """Under a budget the allocator cannot serve: torch's oom entry (size: the cudaMalloc that failed, device_free);
    a run that goes on does so as gpu_memory does, one that stops ends with it."""
    _, free_run = _run(TINY, GPU)
    dm = gpu_memory(free_run.log, 0)
    budget = dm.outside_total + dm.reserved_peak.reserved // 2
    for stop in (False, True):
        _, report = _run(TINY, GPU, budget, stop)
        snap = to_snapshot(report.log)
        trace = snap["device_traces"][0]
        ooms = [i for i, e in enumerate(trace) if e["action"] == "oom"]
        # torch's own form: device_free, no addr (torch/csrc/cuda/memory_snapshot.cpp); peakledger's reader takes it
        assert len(ooms) == 1 and "addr" not in trace[ooms[0]] and trace[ooms[0]]["device_free"] >= 0
        e = trace[ooms[0]]
        assert e["size"] > e["device_free"] and e["size"] % (2 << 20) == 0
        assert (ooms[0] == len(trace) - 1) == stop
        got = _replay_trace(trace)
        capped = gpu_memory(report.log, 0, series=True)
        assert got["peak_reserved"] == capped.reserved_peak.reserved and got["reserved"] == capped.series[-1][2]


def test_cpu_profile_exports_one_segment_per_tensor():
    """No caching allocator on the cpu profile: each tensor is its own segment (512 B unit), freed with it."""
    _, report = _run(TINY, {"device": "cpu"})
    snap = to_snapshot(report.log)
    assert snap["allocator_settings"] == {} and "cpu" in snap["peakledger"]["allocator"]
    live = [e for e in report.log.events if e.block.pool is Pool.DEVICE]
    alive: dict[int, int] = {}
    for e in live:
        if e.action is Action.ALLOC and e.block.nbytes:
            alive[e.block.id] = e.block.nbytes
        else:
            alive.pop(e.block.id, None)
    segs = snap["segments"]
    assert len(segs) == len(alive) and all(len(s["blocks"]) == 1 for s in segs)
    assert sorted(s["requested_size"] for s in segs) == sorted(alive.values())
    assert all(s["total_size"] == round_size(s["requested_size"]) for s in segs)
    got = _replay_trace(snap["device_traces"][0])
    assert got["allocated"] == sum(alive.values()) and got["reserved"] == sum(s["total_size"] for s in segs)
    assert got["segment_alloc"] - got["segment_free"] == len(segs)
    from torch.cuda import _memory_viz
    assert f"segments: {len(segs)}" in _memory_viz.segsum(snap)


def test_snapshot_bytes_are_deterministic(tmp_path):
    paths = []
    for i in range(2):
        _, report = _run(*BUSY)
        paths.append(tmp_path / f"{i}.pickle")
        write_snapshot(report.log, str(paths[-1]))
    assert paths[0].read_bytes() == paths[1].read_bytes()


# --- the Chrome trace

def _nested(slices: list[dict]) -> bool:
    """X slices on each (pid, tid) nest: each lies inside the one open around it, or after it."""
    tracks: dict[tuple, list[dict]] = {}
    for s in slices:
        tracks.setdefault((s["pid"], s["tid"]), []).append(s)
    eps = 1e-6
    for track in tracks.values():
        stack: list[float] = []  # the ends of the slices open around the current one
        for s in sorted(track, key=lambda x: (x["ts"], -x["dur"])):
            end = s["ts"] + s["dur"]
            while stack and stack[-1] <= s["ts"] + eps:
                stack.pop()
            if stack and end > stack[-1] + eps:
                return False
            stack.append(end)
    return True


def test_chrome_trace_from_the_graph_has_every_op_and_phase_at_the_engines_times(case):
    name, graph, report, _ = case
    trace = chrome_trace(report.log, graph)
    assert trace["otherData"]["slices"] == FROM_GRAPH
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    ops = [e for e in xs if e["cat"].startswith("op")]
    assert len(ops) == len(graph.ops_in_order())
    assert sorted((e["pid"], e["name"], e["args"]["step"]) for e in ops) == \
        sorted((op.rank, op.name, op.step) for op in graph.ops_in_order())
    by_op = {(e["pid"], e["name"], e["args"]["step"], e["args"]["micro_batch_index"], e["args"]["phase"]): e
             for e in ops}
    ends = {}
    for e in report.log.events:  # the log's allocations come at an op's start, its frees at its end
        x = by_op[(e.block.rank, e.op, e.step, e.micro_batch_index, e.phase.value)]
        ends.setdefault(e.action, []).append((x, e.time * 1e6))
    assert all(x["ts"] == t for x, t in ends[Action.ALLOC])
    assert all(abs(x["ts"] + x["dur"] - t) <= 1e-6 * max(1.0, t) for x, t in ends[Action.FREE])
    phases = {(e["pid"], e["name"], e["args"]["step"], e["args"]["micro_batch_index"]) for e in xs
              if e["cat"] == "phase"}
    assert phases == {(op.rank, phase_label(op.phase, op.name), op.step, op.micro_batch_index)
                      for op in graph.ops_in_order()}
    steps = {(e["pid"], e["args"]["step"]) for e in xs if e["cat"] == "step"}
    assert steps == {(op.rank, op.step) for op in graph.ops_in_order()}
    if name == "busy":
        labels = {p[1] for p in phases}
        assert {"checkpoint save", "checkpoint load", "load", "forward", "backward", "optimizer"} <= labels
        assert {e["tid"] for e in ops} == {0, 1}  # compute and communication streams
    assert _nested(xs)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert all(names[(e["pid"], e["tid"])] in ("compute", "communication", "host") for e in xs)


def test_chrome_trace_from_the_cli_is_valid_json_with_slices(cli_files):
    _, _, chrome = cli_files
    data = json.loads(chrome.read_text())
    assert data["otherData"]["slices"] == FROM_GRAPH  # the CLI exports the graph it simulated: every op a slice
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert xs and all(e["dur"] >= 0 for e in xs) and _nested(xs)
    graph, report = _run(TINY, GPU)
    assert {e["name"] for e in xs if e["cat"] == "op"} == {op.name for op in graph.ops_in_order()} >= {e.op for e in
                                                                                             report.log.events}
    assert {(e["name"], e["args"]["step"]) for e in xs if e["cat"] == "phase"} == \
        {(phase_label(e.phase, e.op), e.step) for e in report.log.events}
    assert {e["ph"] for e in data["traceEvents"]} == {"M", "X", "C", "i"}
    assert all(isinstance(e.get("tid", 0), int) and isinstance(e["pid"], int) for e in data["traceEvents"])


def test_chrome_trace_bytes_are_deterministic(tmp_path):
    out = []
    for i in range(2):
        graph, report = _run(*BUSY)
        for g in (graph, None):
            path = tmp_path / f"{i}-{g is None}.json"
            write_chrome_trace(report.log, str(path), g)
            out.append(path.read_bytes())
    assert out[0] == out[2] and out[1] == out[3] and out[0] != out[1]
    assert not re.search(rb"NaN|Infinity", out[0])


def test_export_help_says_what_the_files_hold(capsys):
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "segment_plot" in text and "--device cpu" in text and "phase and op duration slices" in text


def test_a_snapshot_with_torchs_oom_entry_is_read(tmp_path):
    """torch writes an oom trace entry with `device_free` and no `addr`; peakledger's own reader takes it and keeps
    the OOM with its capacity (the live bytes plus what the device had free)."""
    _, free_run = _run(TINY, GPU)
    dm = gpu_memory(free_run.log, 0)
    _, report = _run(TINY, GPU, dm.outside_total + dm.reserved_peak.reserved // 2, True)
    path = tmp_path / "oom.pickle"
    write_snapshot(report.log, str(path))
    entry = next(e for e in pickle.loads(path.read_bytes())["device_traces"][0] if e["action"] == "oom")
    assert "addr" not in entry
    log = load_snapshot(str(path)).allocated
    assert len(log.ooms) == 1 and log.ooms[0].capacity == log.ooms[0].live_bytes + entry["device_free"]
