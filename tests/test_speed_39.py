"""Issue 39's speed contracts, as behaviour (no timings): one allocator replay per report, no reference cycles left
by a run, a CLI that starts without torch or matplotlib, and an API that is silent unless asked for progress."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys

from peakledger import api, diagnosis
from peakledger.analysis import device
from peakledger.analysis.report import report_json
from peakledger.models.builder import GraphBuilder
from peakledger.scenario import build_scenario
from peakledger.simulator.allocator.blocks import Block as AllocatorBlock
from peakledger.simulator.events import Block
from peakledger.simulator.ops import Op


def _gpt2(**training):
    return build_scenario({"preset": "gpt2"}, {"micro_batch": 2, "seq_len": 256, **training}, {"device": "H100-80GB"})


def test_a_shown_report_replays_the_allocator_once(monkeypatch):
    calls = []
    real = device.device_memory

    def counted(*args, **kwargs):
        calls.append(kwargs.get("series", args[6] if len(args) > 6 else False))
        return real(*args, **kwargs)

    monkeypatch.setattr(device, "device_memory", counted)
    report = api.run(_gpt2())
    out = report_json(report)  # the phase table, the device keys, the ledger: everything a shown report reads
    assert len(calls) == 1 and calls == [True]
    assert report.gpu_series is report.gpu
    assert len(report.gpu.series) == len(report.timeline.events)  # one point per device event of the rank
    phases = out["phases"]
    assert phases and all(p["reserved"] is not None for p in phases)
    # each phase's reserved peak is the highest reserved of the series' points inside that phase
    for p in phases:
        points = [r for (_, _, r), e in zip(report.gpu.series, report.timeline.events)
                  if (e.step, e.phase.value) == (p["step"], p["phase"])]
        assert p["reserved"] == max(points)


def test_a_run_leaves_no_reference_cycles():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        report = api.run(_gpt2())
        api.card_fit(report, 1 << 30)  # (bounded replays of every rank too)
        del report
        gc.collect()
        kinds = {type(o) for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    # the graph's ops and blocks, the builders and the allocator model's blocks are freed by reference counts
    assert not kinds & {Op, Block, GraphBuilder, AllocatorBlock}


def test_the_cli_starts_without_torch_or_matplotlib():
    code = "import sys, peakledger.cli; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_api_is_silent_by_default(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="peakledger"):
        api.run(_gpt2())
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "" and caplog.records == []


def test_run_reports_its_three_stages_to_the_callback_and_the_log(caplog):
    seen = []
    with caplog.at_level(logging.INFO, logger="peakledger"):
        api.run(_gpt2(), progress=lambda i, n, what: seen.append((i, n, what.split()[0])))
    assert seen == [(0, 3, "describing"), (1, 3, "simulating"), (2, 3, "summarizing")]
    assert [r.getMessage().split()[0] for r in caplog.records if r.name == "peakledger"] == \
        ["describing", "simulating", "summarizing"]


def test_explain_reports_the_base_run_then_each_fix():
    seen = []
    sc = _gpt2()
    budget = api.run(sc).peaks.overall.bytes // 2  # it does not fit: fixes, then the GPU counts
    x = diagnosis.explain(sc, budget, progress=lambda i, n, what: seen.append((i, n, what)))
    assert seen[0] == (0, None, f"simulating {sc.name} as it is")
    steps = seen[1][1]
    done = seen[1:]  # each fix and each layout's GPU search once, as it is done (two at once on two cores)
    assert [i for i, _, _ in done] == list(range(1, steps)) and all(n == steps for _, n, _ in done)
    assert sum(what.startswith("searched the fewest GPUs that fit (") for _, _, what in done) == 3 and not x.fits
    assert sum(what.startswith("re-simulated: ") for _, _, what in done) == steps - 4
    assert x.tried >= len(x.fixes)


def test_max_micro_batch_reports_each_probe_once():
    seen = []
    sc = _gpt2()
    best = api.max_micro_batch(sc, 8 << 30, progress=lambda i, n, what: seen.append((i, n, what)))
    probes = [int(what.rsplit(" ", 1)[1]) for _, _, what in seen]
    assert [i for i, _, _ in seen] == list(range(len(seen))) and len(set(probes)) == len(probes)
    assert best in probes and all(n is None for _, n, _ in seen)
