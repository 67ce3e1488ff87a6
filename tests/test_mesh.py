"""The device mesh (models/parallel/mesh.py): a global rank's coordinates, what each rank runs when tp, pp and dp
combine (the tensor-parallel tape, cut into the rank's stages, under the data-parallel engine of its dp group),
and the rank classes against their definition (a builder per rank, grouped by what makes their bytes differ)."""

from __future__ import annotations

import pytest

from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.devices import device_profile
from peakledger.models.parallel import dim0_shard, flat_partition
from peakledger.models.parallel.mesh import (
    MeshTapes,
    mesh_classes,
    mesh_coords,
    mesh_rank,
    rank_builder,
    simulated_ranks,
)
from peakledger.models.parallel.stages import rank_tape, stage_tapes
from peakledger.models.parallel.tensor import tensor_parallel_tape
from peakledger.models.presets import preset
from peakledger.models.training import build_tape, describe, engine_classes
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category

TINY = preset("tiny")  # GPT-2 family: 2 layers, 4 heads, 64 wide, vocabulary 256
CPU = device_profile("cpu")


def _setup(**kw) -> TrainingSetup:
    base = dict(micro_batch=2, seq_len=32, precision="fp32")
    if kw.get("pp", 1) > 1:
        base.update(grad_accum=4, pp_schedule="1f1b")
    return TrainingSetup(**{**base, **kw})


def test_coordinates_put_tp_innermost_and_pp_outermost():
    s = _setup(tp=2, pp=2, world_size=12, dp_engine="deepspeed", zero_stage=1)  # dp 3
    assert s.mesh.dp == 3
    seen = set()
    for rank in range(s.mesh.world_size):
        at = mesh_coords(s, rank)
        assert mesh_rank(s, at.pp, at.dp, at.cp, at.tp) == rank
        seen.add((at.pp, at.dp, at.tp))
    assert len(seen) == 12
    assert mesh_coords(s, 1).tp == 1 and mesh_coords(s, 2).dp == 1 and mesh_coords(s, 6).pp == 1


def _static(log, rank: int) -> dict[Category, int]:
    """Bytes allocated at load (parameters, buffers, masters) by category, for one rank."""
    out: dict[Category, int] = {}
    for e in log.events:
        if e.block.rank == rank and e.action is Action.ALLOC and e.step == 0:
            out[e.block.category] = out.get(e.block.category, 0) + e.block.nbytes
    return out


def test_fsdp2_shards_the_tensor_parallel_shards():
    """2D (torchtitan: TP, then fully_shard on the dp mesh): each parameter's TP-local shard chunked on dim 0
    over the dp ranks."""
    s = _setup(tp=2, world_size=4, dp_engine="fsdp2")
    tape = build_tape(TINY, s, True)
    log = simulate(describe(TINY, s, "cpu", ranks=[0, 1, 2, 3]))
    for rank in range(4):
        at = mesh_coords(s, rank)
        local = tensor_parallel_tape(tape, 2, False, at.tp)
        want = sum(dim0_shard(p.shape, 2, at.dp)[0] for p in local.params) * 4
        assert _static(log, rank)[Category.PARAMETER] == want


def test_zero1_partitions_a_pipeline_stage_over_its_dp_group():
    """pp x dp with ZeRO-1: a stage's parameters are whole on every dp rank of its group; its fp32 master and
    optimizer states are 1/dp of the stage's flat group."""
    s = _setup(pp=2, world_size=6, zero_stage=1, precision="bf16-mixed")  # dp 3
    tape = build_tape(TINY, s, True)
    log = simulate(describe(TINY, s, "cpu"))
    for rank in sorted({e.block.rank for e in log.events}):
        at = mesh_coords(s, rank)
        mine = rank_tape(tape, s, at.pp)
        numel = sum(p.numel for p in mine.params)
        static = _static(log, rank)
        assert static[Category.PARAMETER] == flat_partition(numel, 3)[0] * 2  # bf16, padded flat buffer
        assert static[Category.MASTER_PARAMETER] == flat_partition(numel, 3)[1] * 4


def test_fsdp2_under_a_pipeline_shards_each_stage_and_reduces_once():
    """FSDP2 x PP (torchtitan: fully_shard on each stage module): a stage's parameters chunked on dim 0 over its dp
    group; the schedule's backward neither reshards nor reduce-scatters (stage.py `backward_maybe_with_nosync`):
    one reduce-scatter per unit per step, after the last micro-batch (`perform_reduce_grad`)."""
    s = _setup(pp=2, world_size=4, dp_engine="fsdp2")  # dp 2, 4 micro-batches
    tape = build_tape(TINY, s, True)
    log = simulate(describe(TINY, s, "cpu", ranks=[0, 1, 2, 3]))
    for rank in range(4):
        at = mesh_coords(s, rank)
        mine = rank_tape(tape, s, at.pp)
        assert _static(log, rank)[Category.PARAMETER] == sum(dim0_shard(p.shape, 2, at.dp)[0] for p in mine.params) * 4
        units = {op.split("fsdp.reduce_scatter.")[1].removesuffix(".issue") for op in
                 {e.op for e in log.events if e.block.rank == rank and e.step == 1 and "fsdp.reduce_scatter." in e.op}}
        scatters = [e for e in log.events if e.block.rank == rank and e.step == 1 and e.action is Action.ALLOC
                    and e.op.startswith("fsdp.reduce_scatter.") and e.op.endswith(".issue")]
        assert len(scatters) == len(units) and all(e.micro_batch_index == s.batch.grad_accum - 1 for e in scatters)


def test_the_last_stage_gathers_for_backward_after_the_loss():
    """The schedule's loss_fn runs outside the stage module: FSDP2's root pre-backward (and its prefetch) fires when
    the module output's gradient arrives, after the loss's backward (measured: traces/mesh_run.py)."""
    s = _setup(pp=2, world_size=4, dp_engine="fsdp2")
    log = simulate(describe(TINY, s, "cpu", ranks=[2]))
    ops = [e.op for e in log.events if e.block.rank == 2 and e.step == 1 and e.micro_batch_index == 0
           and e.phase.value == "backward"]
    first_gather = next(i for i, op in enumerate(ops) if op.startswith("fsdp.all_gather."))
    assert all(not op.startswith("loss.") for op in ops[first_gather:])


def test_tp_then_pp_cuts_the_tensor_parallel_tape():
    s = _setup(tp=2, pp=2, world_size=4)
    tape = build_tape(TINY, s, True)
    tapes = MeshTapes(tape, s)
    for rank in range(4):
        at = mesh_coords(s, rank)
        b = rank_builder(tape, s, CPU, rank, tapes=tapes)
        local = tensor_parallel_tape(tape, 2, False, at.tp)
        cut = [st for st in stage_tapes(local, tapes.local) if st.spec.rank == at.pp]
        assert {p.name: p.shape for p in b.tape.params} == {
            p.name: p.shape for p in local.params if any(p.name in st.params for st in cut)} | (
            {"lm_head.weight": next(p.shape for p in local.params if p.name == "transformer.wte.weight")}
            if any(st.spec.last for st in cut) else {})
        assert b.engine.n == 1 and b.rank == rank


@pytest.mark.parametrize("kw", [
    dict(tp=2, world_size=4, dp_engine="fsdp2"),
    dict(tp=2, world_size=6, dp_engine="fsdp2"),  # dp 3: uneven dim-0 shards
    dict(tp=2, world_size=4, zero_stage=3),
    dict(pp=2, world_size=4, zero_stage=1),
    dict(tp=2, pp=2, world_size=8, zero_stage=0),
    dict(tp=2, pp=2, world_size=4, sequence_parallel=True),
    dict(pp=2, world_size=6, dp_engine="fsdp2"),  # dp 3: uneven shards on a pipeline
    dict(tp=2, pp=2, world_size=8, dp_engine="fsdp2"),
])
def test_mesh_classes_equal_the_definition(kw):
    """A class: the ranks with the same pipeline stage, the same tensor-parallel shapes and the same engine
    signature; every rank in exactly one class, each pipeline group simulated whole."""
    s = _setup(**kw)
    tape = build_tape(TINY, s, True)
    tapes = MeshTapes(tape, s)
    classes = mesh_classes(tapes, CPU, engine_classes)
    brute: dict[tuple, list[int]] = {}
    for rank in range(s.mesh.world_size):
        b = rank_builder(tape, s, CPU, rank, tapes=tapes)
        key = (mesh_coords(s, rank).pp, tuple((p.name, p.shape) for p in b.tape.params), b.engine.signature())
        brute.setdefault(key, []).append(rank)
    assert {r: list(m) for r, m in classes.items()} == {m[0]: m for m in sorted(brute.values())}
    sim = simulated_ranks(classes, s)
    for rank in sim:
        at = mesh_coords(s, rank)
        assert all(mesh_rank(s, p, at.dp, at.cp, at.tp) in sim for p in range(s.mesh.pp))


def test_a_million_ranks_take_few_classes():
    s = TrainingSetup(micro_batch=1, seq_len=32, precision="bf16-mixed", tp=2, pp=2, world_size=1_048_576,
                      grad_accum=4, pp_schedule="1f1b", zero_stage=1)
    tape = build_tape(TINY, s, False)
    classes = mesh_classes(MeshTapes(tape, s), device_profile("H100-80GB"), engine_classes)
    assert sorted(len(m) for m in classes.values()) == [s.mesh.world_size // 2] * 2
    assert all(len(m.ranges) == 1 for m in classes.values())


def test_pipeline_ranks_under_full_checkpointing_hold_less():
    plain = simulate(describe(TINY, _setup(pp=2, world_size=2, micro_batch=8, seq_len=64), "cpu"))
    full = simulate(describe(TINY, _setup(pp=2, world_size=2, micro_batch=8, seq_len=64, checkpointing="full"),
                             "cpu"))

    def peak(log, rank):
        live = top = 0
        for e in log.events:
            if e.block.rank == rank:
                live += e.block.nbytes if e.action is Action.ALLOC else -e.block.nbytes
                top = max(top, live)
        return top
    assert peak(full, 0) < peak(plain, 0)
    assert any(e.block.rank == 0 and "recompute" in e.op for e in full.events)


@pytest.mark.parametrize("kw, field", [
    (dict(pp=2, world_size=4, dp_engine="ddp"), "dp_engine"),
    (dict(pp=2, world_size=4, dp_engine="fsdp2", pp_schedule="interleaved-1f1b", virtual_stages=2), "pp_schedule"),
    (dict(pp=2, world_size=2, checkpointing="offload"), "checkpointing"),
    (dict(tp=2, world_size=2, checkpointing="selective"), "checkpointing"),
])
def test_combinations_not_simulated_yet_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        build_tape(TINY, _setup(**kw), True)
    assert e.value.field == field and "not simulated yet" in str(e.value)


def test_zero_3_under_pp_is_refused_as_deepspeed_refuses_it():
    with pytest.raises(ConfigError) as e:
        build_tape(TINY, _setup(pp=2, world_size=4, zero_stage=3), True)
    assert e.value.field == "zero_stage" and "incompatible with pipeline parallelism" in str(e.value)
