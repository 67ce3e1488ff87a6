"""The log's index (simulator/log_index.py), made once per run and read by the report's passes: on a log written by
hand, each reader's answer worked out by hand; on simulated runs (pipeline ranks, host memory), each reader with the
index gives what its walk over the events gives."""

from __future__ import annotations

import pytest

from peakledger import api
from peakledger.analysis import report as report_module
from peakledger.analysis.host import host_fit, host_uses, judge_host
from peakledger.analysis.report import report_json, run_events, run_seconds, step_ends, summarize
from peakledger.analysis.report_text import render_text
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Action, Category, Event, EventLog, Phase, Pool, Stream, new_block
from peakledger.simulator.log_index import log_index
from peakledger.simulator.timeline import rank_events, rank_peak_points, timeline

A, F = Action.ALLOC, Action.FREE
P, ACT, TMP, GRAD = Category.PARAMETER, Category.ACTIVATION, Category.TEMPORARY, Category.GRADIENT


def _log() -> EventLog:
    """Two ranks, rank 0 with host memory; (action, block, step) in the log's order, one time unit apart."""
    blocks = {name: new_block(i, n, cat, name, "fp32", rank=r, pool=pool, pinned=pinned)
              for i, (name, n, cat, r, pool, pinned) in enumerate([
                  ("a", 100, P, 0, Pool.DEVICE, False), ("e", 40, P, 1, Pool.DEVICE, False),
                  ("b", 50, ACT, 0, Pool.DEVICE, False), ("h", 10, Category.OPTIMIZER_STATE, 0, Pool.HOST, True),
                  ("f", 40, GRAD, 1, Pool.DEVICE, False), ("c", 30, TMP, 0, Pool.DEVICE, False),
                  ("i", 5, Category.CHECKPOINT_STAGING, 0, Pool.HOST, False), ("g", 40, GRAD, 1, Pool.DEVICE, False),
                  ("d", 70, ACT, 0, Pool.DEVICE, False)])}
    order = [(A, "a", 0), (A, "e", 0), (A, "b", 1), (A, "h", 1), (A, "f", 1), (A, "c", 1), (A, "i", 1), (F, "c", 1),
             (F, "h", 1), (F, "f", 1), (F, "b", 1), (A, "g", 2), (A, "d", 2), (F, "d", 2)]
    events = [Event(seq=k, time=0 if k == 0 else float(k), action=act, block=blocks[name], phase=Phase.FORWARD,
                    step=step, micro_batch_index=0, stream=Stream.COMPUTE, op=f"op{k}")
              for k, (act, name, step) in enumerate(order)]
    return EventLog(events=events, source="hand")


def test_the_index_of_a_log_written_by_hand():
    log = _log()
    index = log_index(log)
    assert index.ranks() == [0, 1] and index.has_pool(Pool.HOST)
    assert index.delta.tolist() == [100, 40, 50, 10, 40, 30, 5, -30, -10, -40, -50, 40, 70, -70]
    assert index.positions(0, Pool.DEVICE).tolist() == [0, 2, 5, 7, 10, 12, 13]
    # rank 0's device: 100, 150, 180 (a + b + c), 150, 100, 170, 100: the peak is its third event
    # rank 1's: 40, 80, 40, 80: the first 80 (ties go to the earliest)
    points = rank_peak_points(log, Pool.DEVICE, index)
    assert sorted(points) == [0, 1]
    assert (points[0].bytes, points[0].index, points[0].event.op) == (180, 2, "op5")
    assert list(points[0].live_by_category.items()) == [(P, 100), (ACT, 50), (TMP, 30)]
    assert (points[1].bytes, points[1].index, points[1].event.op) == (80, 1, "op4")
    assert list(points[1].live_by_category.items()) == [(P, 40), (GRAD, 40)]
    host = rank_peak_points(log, Pool.HOST, index)
    assert list(host) == [0] and (host[0].bytes, host[0].index) == (15, 1)
    # host: 10 pinned, then 5 pageable (15, 10 of it pinned), then the pinned 10 freed
    use = host_uses(log, index)[0]
    assert (use.peak, use.pinned_at_peak, use.pinned_peak) == (15, 10, 10)
    ends = step_ends(log, index)
    assert ends == {0: {0: 0, 1: 10.0, 2: 13.0}, 1: {0: 1.0, 1: 9.0, 2: 11.0}}
    assert type(ends[0][0]) is int  # read from the event: the clock's int 0 stays an int
    tl = timeline(log, 1, Pool.DEVICE, index=index)
    assert tl.total.tolist() == [40, 80, 40, 80] and tl.by_category[GRAD].tolist() == [0, 40, 0, 40]
    assert [i for i, _ in rank_events(log, 1, index)] == [1, 4, 9, 11]


def _same_without(log):
    """Each reader with the log's index against its own walk over the events."""
    index = log_index(log)
    for pool in Pool:
        assert rank_peak_points(log, pool, index) == rank_peak_points(log, pool)
    assert step_ends(log, index) == step_ends(log)
    assert run_seconds(log, index) == run_seconds(log) and run_events(log, index) == run_events(log)
    assert host_uses(log, index) == host_uses(log)
    assert host_fit(log, 1 << 40, index=index) == host_fit(log, 1 << 40)
    assert judge_host(log, "H100-80GB", index=index) == judge_host(log, "H100-80GB")
    for rank in index.ranks():
        assert rank_events(log, rank, index) == rank_events(log, rank)
        for pool in Pool:
            a, b = timeline(log, rank, pool, index=index), timeline(log, rank, pool)
            assert a.events == b.events and a.total.tolist() == b.total.tolist()
            assert a.times.tolist() == b.times.tolist()
            assert {c: v.tolist() for c, v in a.by_category.items()} == {c: v.tolist()
                                                                          for c, v in b.by_category.items()}


def test_readers_with_the_index_agree_with_their_walks_on_a_hand_log():
    _same_without(_log())


@pytest.mark.parametrize("training", [
    {"pp": 2, "world_size": 4, "grad_accum": 4, "pp_schedule": "1f1b", "steps": 3},
    {"optimizer_offload": "states", "steps": 2, "world_size": 2, "dp_engine": "fsdp2"},
])
def test_readers_with_the_index_agree_with_their_walks_on_simulated_runs(training, monkeypatch):
    sc = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, **training}, {"device": "H100-80GB"})
    report = api.run(sc)
    _same_without(report.log)
    assert report.index is not None and report.timeline is report.peak_timeline
    # the report made without an index (every reader walking the events, as for a log over int64) says the same
    monkeypatch.setattr(report_module, "log_index", lambda log: None)
    plain = summarize(report.log, name=report.name)
    assert plain.index is None
    assert report_json(plain) == report_json(report)
    assert render_text(plain) == render_text(report)


def test_a_log_whose_bytes_could_leave_int64_has_no_index():
    log = _log()
    big = new_block(99, 2**62, P, "huge", "fp32")
    log.events += [Event(seq=14 + k, time=20.0 + k, action=A, block=big, phase=Phase.FORWARD, step=2,
                         micro_batch_index=0, stream=Stream.COMPUTE, op="huge") for k in range(2)]
    assert log_index(log) is None
