"""Timelines in numpy (simulator/timeline.py): the int64 running sums and `Timeline.peak_in` are the Python-int
sums and `Timeline.peak(where)` of the same events, value for value, category order included; past int64 the
timeline counts with Python ints and `peak_in` falls back to `peak`."""

from __future__ import annotations

import numpy as np
import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator import timeline as tl_module
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Pool
from peakledger.simulator.timeline import timeline


@pytest.fixture(scope="module")
def log():
    setup = TrainingSetup(micro_batch=2, seq_len=16, grad_accum=2, steps=3, checkpointing="full",
                          optimizer_offload="chunked", offload_chunk_params=20_000)
    return simulate(describe(preset("tiny"), setup, "H100-80GB"))


def _python_columns(events):
    running, total, totals, columns = {}, 0, [], {}
    for e in events:
        c = e.block.category
        running[c] = running.get(c, 0) + e.delta
        total += e.delta
        totals.append(total)
        for k in running:
            columns.setdefault(k, [0] * (len(totals) - 1))
        for k in columns:
            columns[k].append(running.get(k, 0))
    return totals, columns


@pytest.mark.parametrize("pool", [Pool.DEVICE, Pool.HOST])
def test_numpy_timeline_is_the_python_sums(log, pool, monkeypatch):
    tl = timeline(log, 0, pool)
    assert tl.total.dtype == np.int64 and len(tl.events) > 0
    totals, columns = _python_columns(tl.events)
    assert tl.total.tolist() == totals
    assert {c: v.tolist() for c, v in tl.by_category.items()} == columns
    assert list(tl.by_category) == sorted(columns, key=list(type(next(iter(columns)))).index)
    monkeypatch.setattr(tl_module, "INT64_MAX", 10)  # the Python-int path: the same values
    slow = timeline(log, 0, pool)
    assert slow.total.tolist() == totals and list(slow.by_category) == list(tl.by_category)


def test_peak_in_is_peak_where(log):
    tl = timeline(log, 0, Pool.DEVICE)
    steps = np.array([e.step for e in tl.events])
    for where, mask in [(None, None), (lambda e: e.step <= 1, steps <= 1), (lambda e: e.step >= 2, steps >= 2),
                        (lambda e: e.step >= 99, steps >= 99)]:
        a, b = tl.peak(where), tl.peak_in(mask)
        assert a == b and list(a.live_by_category) == list(b.live_by_category)
    tl_obj = type(tl)(tl.rank, tl.pool, tl.events, tl.times, tl.total.astype(object),
                      {c: v.astype(object) for c, v in tl.by_category.items()})
    assert tl_obj.peak_in(steps >= 2) == tl.peak(lambda e: e.step >= 2)
