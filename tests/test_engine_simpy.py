"""The engine (simulator/engine.py: SimPy's scheduling discipline without SimPy's objects) against the same engine on
SimPy itself (simulator/simpy_engine.py, `--simulator simpy`: the engine as it ran up to commit 5a3656a): every event
of every log equal, field for field, and the OOM records and stop, on graphs of every shape the describers make: one
rank, data-parallel ranks with collectives on their communication streams, pipeline schedules linking ranks, tensor
parallelism, offload to the host, checkpoint saves, an OOM that stops the run and one that does not; and a process of
the user's own beside the streams."""

from __future__ import annotations

import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Pool
from peakledger.simulator.simpy_engine import simulate as simpy_simulate

CASES = {
    "one rank": ("tiny", dict(micro_batch=2, seq_len=64, grad_accum=2, steps=2)),
    "fsdp2 x 4": ("tiny", dict(world_size=4, dp_engine="fsdp2", steps=2)),
    "zero-3 x 4": ("tiny-llama", dict(world_size=4, zero_stage=3, steps=2)),
    "ddp x 2, checkpointing": ("tiny", dict(world_size=2, dp_engine="ddp", checkpointing="full", steps=2)),
    "1f1b pp 4": ("tiny", dict(pp=4, world_size=4, grad_accum=8, steps=2)),
    "interleaved pp 2 x 2": ("tiny", dict(pp=2, world_size=2, pp_schedule="interleaved-1f1b", virtual_stages=2,
                                           grad_accum=4, steps=2)),
    "tp 2 x pp 2, sp": ("tiny-llama", dict(tp=2, pp=2, world_size=4, grad_accum=4, sequence_parallel=True,
                                            steps=2)),
    "offload and saves": ("tiny", dict(optimizer_offload="states", checkpoint_every=1, steps=2)),
}


def _same(a, b) -> None:
    assert len(a.events) == len(b.events)
    for x, y in zip(a.events, b.events):
        assert x == y
    assert a.ooms == b.ooms
    assert a.metadata == b.metadata


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_simpy(name):
    model, setup = CASES[name]
    graph = describe(preset(model), TrainingSetup(**{"micro_batch": 2, "seq_len": 64, **setup}), "H100-80GB")
    _same(simulate(graph), simpy_simulate(graph))


@pytest.mark.parametrize("stop", [True, False])
def test_engine_matches_simpy_at_an_oom(stop):
    graph = describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=64, world_size=2, dp_engine="fsdp2",
                                                   steps=2), "H100-80GB")
    free = simulate(graph)
    peak = max(sum(e.delta for e in free.events[:i + 1] if e.block.rank == 0 and e.block.pool is Pool.DEVICE)
               for i in range(0, len(free.events), 97))
    capacities = {(0, Pool.DEVICE): peak // 2}
    a, b = simulate(graph, capacities, stop_on_oom=stop), simpy_simulate(graph, capacities, stop_on_oom=stop)
    assert a.ooms and (a.metadata.stopped_at_oom is True) is stop
    _same(a, b)


def test_the_simpy_engine_runs_a_users_process_beside_the_streams():
    """A data loader of one's own: it holds a pinned host buffer from time 0 until the first backward starts."""
    graph = describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=32, steps=1), "cpu")
    first_backward = next(op for op in graph.ops_in_order() if op.phase.value == "backward")
    seen = []

    def loader(sim):
        seen.append(sim.env.now)
        yield sim.env.timeout(1e-6)
        seen.append(sim.env.now)

    log = simpy_simulate(graph, processes=[loader])
    assert seen == [0, 1e-6] and first_backward.name in {e.op for e in log.events}
    assert [(e.seq, e.block.id, e.action) for e in log.events] == \
        [(e.seq, e.block.id, e.action) for e in simulate(graph).events]  # the streams' log is the built-in one's


def test_simulate_takes_the_simpy_engine_by_name(capsys):
    from peakledger.cli import main

    assert main(["simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--json"]) == 0
    builtin = capsys.readouterr().out
    assert main(["simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--json",
                 "--simulator", "simpy"]) == 0
    assert capsys.readouterr().out == builtin
