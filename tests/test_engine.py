"""The SimPy engine on hand-built op graphs: ordering rule, streams, OOM at the exact event."""

from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Block, Category, Phase, Pool, Stream
from peakledger.simulator.ops import Op, OpGraph
from peakledger.simulator.timeline import timeline


def blk(i, n, cat=Category.ACTIVATION, name=None):
    return Block(id=i, nbytes=n, category=cat, name=name or f"t{i}", dtype="fp32")


def op(i, allocs=(), frees=(), duration=1.0, stream=Stream.COMPUTE, name=None):
    return Op(id=i, name=name or f"op{i}", stream=stream, phase=Phase.FORWARD, step=1, micro_batch_index=0,
              duration=duration, allocs=tuple(allocs), frees=tuple(frees))


def test_an_op_allocates_its_output_before_freeing_its_input_even_at_zero_duration():
    g = OpGraph()
    g.add(op(0, [blk(1, 10)]))
    g.add(op(1, [blk(2, 5)], [1], duration=0.0))
    log = simulate(g)
    assert [(e.action, e.block.id) for e in log.events] == [(Action.ALLOC, 1), (Action.ALLOC, 2), (Action.FREE, 1)]
    assert timeline(log).peak().bytes == 15
    assert timeline(log).peak().event.op == "op1"


def test_oom_is_recorded_at_the_first_allocation_that_does_not_fit_with_the_live_set():
    g = OpGraph()
    g.add(op(0, [blk(1, 10, Category.PARAMETER)]))
    g.add(op(1, [blk(2, 5)], [1]))
    g.add(op(2, [blk(3, 100)]))
    log = simulate(g, {(0, Pool.DEVICE): 12}, stop_on_oom=True)
    (oom,) = log.ooms
    assert oom.event.block.id == 2 and oom.live_bytes == 10 and oom.capacity == 12
    assert oom.live_by_category == {Category.PARAMETER: 10}
    assert [e.block.id for e in log.events] == [1]  # stopped there; the failed allocation never happened
    cont = simulate(g, {(0, Pool.DEVICE): 12}, stop_on_oom=False)
    assert len(cont.ooms) == 1 and len(cont.events) == 4


def test_streams_overlap_and_dependencies_hold():
    g = OpGraph()
    g.add(op(0, [blk(1, 4)], duration=2.0))
    g.add(op(1, [blk(2, 8)], [2], duration=1.0, stream=Stream.COMMUNICATION))  # independent: starts at 0
    g.add(op(2, [blk(3, 1)], [1, 3], duration=1.0, stream=Stream.COMMUNICATION), after=[0])
    log = simulate(g)
    times = {(e.action, e.block.id): e.time for e in log.events}
    assert times[(Action.ALLOC, 2)] == 0.0 and times[(Action.ALLOC, 1)] == 0.0
    assert times[(Action.ALLOC, 3)] == 2.0  # waited for op0 on the other stream
    assert timeline(log).peak().bytes == 12


def test_freeing_an_unallocated_block_is_rejected():
    g = OpGraph()
    g.add(op(0, [], [99]))
    try:
        simulate(g)
    except ValueError as e:
        assert "99" in str(e)
    else:
        raise AssertionError("expected ValueError")
