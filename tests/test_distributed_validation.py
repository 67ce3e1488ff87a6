"""The simulator's data-parallel ranks against real torch engines on 2 ranks: static rows exact, per-rank
peak within 2%, the all-gather transient in both. The ranks run torch's FSDP2 / DDP /
ZeroRedundancyOptimizer against the fake process group, whose order of frees is deterministic (gloo's
worker threads release collective outputs a moment late in some runs; bench/validate_distributed.py
shows the gloo runs)."""

from __future__ import annotations

import pytest

from peakledger.analysis.validate import compare_logs, static_rows, transient_peak
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category
from peakledger.traces.distributed import measure_distributed, without_backend_copies


@pytest.mark.parametrize("engine", ["fsdp2", "zero-redundancy-optimizer"])
def test_two_ranks_match_the_real_engine(engine):
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, world_size=2, dp_engine=engine)
    measured = [without_backend_copies(log) for log in measure_distributed(preset("tiny"), setup, 2, engine,
                                                                                  backend="fake")]
    simulated = simulate(describe(preset("tiny"), setup, "cpu", ranks=[0, 1]))
    for rank, log in enumerate(measured):
        assert static_rows(log, rank) == static_rows(simulated, rank)
        assert compare_logs(log, simulated, rank=rank).passes(0.02)
        gathered = transient_peak(log, Category.ALL_GATHER_BUFFER, rank)
        assert gathered == transient_peak(simulated, Category.ALL_GATHER_BUFFER, rank)
        assert (gathered > 0) == (engine == "fsdp2")
