"""The simulator's data-parallel ranks against real torch engines on 2 ranks: static rows exact, per-rank
peak within 2%, the all-gather transient in both. The ranks run torch's FSDP2 / ZeroRedundancyOptimizer
against the fake process group (no transport; bench/validate_distributed.py also shows gloo).

One race is torch's own: in some runs (measured: about 1 in 5) FSDP2's pre-backward hook runs on
autograd's worker thread and the previous unit's all-gather output is dropped only after the next
unit's all-gather is allocated, so that rank's measured peak is one all-gather output higher. The test
accepts exactly that and nothing else: the only block the measured peak has beyond the simulated one
must be an all-gather output."""

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
        v = compare_logs(log, simulated, rank=rank)
        if not v.passes(0.02):
            late = [b for side, b in v.unexplained if side == "measured only" and b.nbytes > 8]
            assert [b.category for b in late] == [Category.ALL_GATHER_BUFFER], v.unexplained
            assert 0 < v.overall.measured - v.overall.predicted <= late[0].nbytes
        gathered = transient_peak(log, Category.ALL_GATHER_BUFFER, rank)
        assert gathered == transient_peak(simulated, Category.ALL_GATHER_BUFFER, rank)
        assert (gathered > 0) == (engine == "fsdp2")
