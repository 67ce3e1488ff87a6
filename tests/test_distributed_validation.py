"""The simulator's data-parallel ranks against real torch engines on 2 ranks: static rows exact, per-rank
peak within 2%, the all-gather transient in both. The ranks run torch's FSDP2 / ZeroRedundancyOptimizer
on torch's fake process group (no transport) and FSDP2 on gloo too (docs/commands.md's `validate --world-size 2
--dp-engine fsdp2`).

No race is tolerated: every FSDP2 collective returns only once the process group has released its
tensors (traces/distributed.py `BackendReleased`), so gloo's worker threads can no longer free an
all-gather output after the next unit's is allocated, and the peak is the same in every run."""

from __future__ import annotations

import pytest

from peakledger.analysis.validate import compare_logs, static_rows, transient_peak
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category
from peakledger.traces.distributed import BACKEND_COPY, measure_distributed, without_backend_copies


@pytest.mark.parametrize("engine, backend", [("fsdp2", "fake"), ("fsdp2", "gloo"),
                                             ("zero-redundancy-optimizer", "fake")])
def test_two_ranks_match_the_real_engine(engine, backend):
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, world_size=2, dp_engine=engine)
    raw = measure_distributed(preset("tiny"), setup, 2, engine, backend=backend)
    measured = [without_backend_copies(log) for log in raw]
    simulated = simulate(describe(preset("tiny"), setup, "cpu", ranks=[0, 1]))
    for rank, log in enumerate(measured):
        assert log.metadata.backend == backend
        if backend == "fake":  # the fake group copies nothing: there is nothing to drop
            assert not [e for e in raw[rank].events if e.block.name.endswith(BACKEND_COPY)]
        if engine == "fsdp2":
            assert log.metadata.backend_release["timeouts"] == 0
        assert static_rows(log, rank) == static_rows(simulated, rank)
        v = compare_logs(log, simulated, rank=rank)
        assert v.passes(0.02), (v.overall, v.unexplained)
        gathered = transient_peak(log, Category.ALL_GATHER_BUFFER, rank)
        assert gathered == transient_peak(simulated, Category.ALL_GATHER_BUFFER, rank)
        assert (gathered > 0) == (engine == "fsdp2")


@pytest.mark.parametrize("engine, optimizer, impl", [("zero-redundancy-optimizer", "adamw", "for-loop"),
                                                     ("zero-redundancy-optimizer", "adafactor", "foreach"),
                                                     ("ddp", "adafactor", "for-loop")])
def test_each_rank_steps_its_parameters_in_torchs_order(engine, optimizer, impl):
    """ZeroRedundancyOptimizer's local optimizer gets the rank's parameters in the partition's order (largest first),
    not the model's: a for-loop step, and Adafactor's foreach groups (>= 2 dims or not, in first-occurrence order),
    depend on it. Every optimizer phase of both real ranks (fake process group) equals the simulation's."""
    setup = TrainingSetup(micro_batch=2, seq_len=1, precision="fp32", steps=2, world_size=2, dp_engine=engine,
                          optimizer=optimizer, optimizer_impl=impl)
    measured = measure_distributed(preset("tiny-mlp"), setup, 2, engine, backend="fake")
    simulated = simulate(describe(preset("tiny-mlp"), setup, "cpu", ranks=[0, 1]))
    for rank, log in enumerate(measured):
        gaps = {p.label: p.predicted - p.measured for p in compare_logs(log, simulated, rank=rank).phases
                if p.label.startswith("optimizer")}
        assert gaps == dict.fromkeys(gaps, 0) and gaps
