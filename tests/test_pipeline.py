"""Pipeline parallelism (models/parallel/pipeline.py): the schedules' per-rank orders against torch's own
(schedules.py) and against orders derived by hand, torchtitan's stage layout, each rank's parameters, the
simulated per-stage peaks against real torch.distributed.pipelining runs (gloo, 127.0.0.1), and bad input.

The real 4-rank runs take a minute or more on two cores: they run with PEAKLEDGER_SLOW=1."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.parallel.stages import rank_actions, rank_stages, stage_layers, stage_layout
from peakledger.models.presets import preset
from peakledger.models.training import build_tape, describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category

slow = pytest.mark.skipif(os.environ.get("PEAKLEDGER_SLOW") != "1",
                          reason="real 4-rank pipeline runs (a minute on 2 cores): PEAKLEDGER_SLOW=1 runs them")


def order(schedule, pp, m, rank, v=1):
    return " ".join(str(a) for a in rank_actions(schedule, pp, m, rank, v))


# -- the orders, derived by hand from torch/distributed/pipelining/schedules.py ---------------------------------

def test_gpipe_runs_every_forward_then_every_backward():
    for rank in range(2):
        assert order("gpipe", 2, 4, rank) == f"{rank}F0 {rank}F1 {rank}F2 {rank}F3 {rank}B0 {rank}B1 {rank}B2 {rank}B3"


def test_1f1b_warms_up_pp_minus_rank_forwards_then_alternates():
    # Schedule1F1B._step_microbatches: min(m, pp - rank) warm-up forwards, then B, F, B, F, ..., then the rest
    assert order("1f1b", 2, 4, 0) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert order("1f1b", 2, 4, 1) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    assert order("1f1b", 4, 4, 0) == "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3"
    assert order("1f1b", 4, 4, 1) == "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3"
    assert order("1f1b", 4, 4, 2) == "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3"
    assert order("1f1b", 4, 4, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3"


def test_interleaved_1f1b_by_hand():
    # pp 2, 2 stages per rank (rank 0: stages 0 and 2), 4 micro-batches: 2 rounds of 2; warm-up
    # (2 - 1) x 2 + 2 x (2 - 1 - rank) forwards, then forward / backward pairs, then the backwards
    assert order("interleaved-1f1b", 2, 4, 0, 2) == \
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert order("interleaved-1f1b", 2, 4, 1, 2) == \
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"


def test_zbv_by_hand():
    # the V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; backward split into I (inputs) and W (weights)
    assert order("zbv", 2, 4, 0, 2) == ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 "
                                        "3F3 3I3 3W3 0I2 0W2 0I3 0W3")
    assert order("zbv", 2, 4, 1, 2) == ("1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 "
                                        "2W2 1I2 2I3 1I3 1W2 2W3 1W3")


# -- the orders against torch's own ----------------------------------------------------------------------------

def _torch_order(actions) -> str:
    from torch.distributed.pipelining import schedules as S

    kinds = {S.FORWARD: "F", S.FULL_BACKWARD: "B", S.BACKWARD_INPUT: "I", S.BACKWARD_WEIGHT: "W"}
    return " ".join(f"{a.stage_index}{kinds[a.computation_type]}{a.microbatch_index}" for a in actions
                    if a is not None and a.computation_type in kinds)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_orders_are_torchs(pp, m):
    from torch.distributed.pipelining import schedules as S

    gpipe = S.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    one_f_one_b = S.Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m)) \
        if m >= pp else {}
    for rank in range(pp):
        assert order("gpipe", pp, m, rank) == _torch_order(gpipe[rank])
        if m >= pp and rank < pp - 1:  # torch's IR of the last rank starts at F1 (its runtime runs F0 first)
            assert order("1f1b", pp, m, rank) == _torch_order(one_f_one_b[rank])
        rounds = max(1, m // pp)
        if m % rounds == 0:
            ns = SimpleNamespace(n_local_stages=2, pp_group_size=pp, _n_microbatches=m, number_of_rounds=rounds,
                                 microbatches_per_round=m // rounds)
            assert order("interleaved-1f1b", pp, m, rank, 2) == \
                _torch_order(S.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank))
        ns = SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
        assert order("zbv", pp, m, rank, 2) == \
            _torch_order(S.ScheduleZBVZeroBubble._calculate_single_rank_operations(ns, rank))


# -- the layout ------------------------------------------------------------------------------------------------

def test_stage_layers_as_torchtitan_splits_them():
    # generate_llm_fqn_per_model_part(stages, layers): embeddings and output count one layer each
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert stage_layers(4, 2) == [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]  # embeddings / head alone
    assert stage_layers(3, 5) == [range(0, 2), range(2, 4), range(4, 5)]  # 7 effective: 3, 2, 2
    assert stage_layers(4, 32) == [range(0, 8), range(8, 17), range(17, 25), range(25, 32)]  # 34: 9, 9, 8, 8
    assert stage_layers(8, 6)[0] == range(0, 0) and stage_layers(8, 6)[-1] == range(6, 6)
    with pytest.raises(ConfigError, match="pp"):
        stage_layers(5, 2)


def test_stages_on_ranks_loop_and_v():
    loop = TrainingSetup(world_size=2, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, grad_accum=4)
    assert [s.rank for s in stage_layout(loop, 6)] == [0, 1, 0, 1]
    assert [s.index for s in rank_stages(loop, 6, 1)] == [1, 3]
    v = TrainingSetup(world_size=2, pp=2, pp_schedule="zbv", virtual_stages=2, grad_accum=4)
    assert [s.rank for s in stage_layout(v, 6)] == [0, 1, 1, 0]


def test_each_parameter_on_one_rank_and_the_tied_head_on_the_last():
    setup = TrainingSetup(micro_batch=2, seq_len=32, world_size=4, pp=4, grad_accum=4)
    graph = describe(preset("tiny"), setup, "cpu", all_steps=True)
    log = simulate(graph)
    params = {r: {e.block.name: e.block.nbytes for e in log.events
                  if e.block.rank == r and e.block.category is Category.PARAMETER} for r in range(4)}
    assert set(params[0]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert set(params[3]) == {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    assert params[3]["lm_head.weight"] == params[0]["transformer.wte.weight"]  # a copy of the tied weight
    names = [n for r in range(4) for n in params[r]]
    assert len(names) == len(set(names))
    tape = build_tape(preset("tiny"), setup, True)
    full = sum(p.numel for p in tape.params) * 4
    assert sum(sum(p.values()) for p in params.values()) == full + params[3]["lm_head.weight"]
    assert graph.metadata.pipeline["actions"][3][:2] == ["3F0", "3B0"]
    timing = graph.metadata.pipeline["timing"]
    assert set(timing) == {0, 1, 2, 3} and all(0 <= t["bubble"] < 1 for t in timing.values())


def test_recv_buffers_and_held_sends_shape_the_stage_peaks():
    """GPipe keeps every micro-batch's activations (and every send) until its backwards; 1F1B at most pp - rank;
    so GPipe's first-stage peak grows with m, 1F1B's does not."""
    def peaks(schedule, m):
        setup = TrainingSetup(micro_batch=2, seq_len=32, world_size=2, pp=2, grad_accum=m, pp_schedule=schedule)
        log = simulate(describe(preset("tiny"), setup, "cpu"))
        from peakledger.simulator.timeline import timeline
        return [timeline(log, r).peak().bytes for r in range(2)]
    assert peaks("gpipe", 8)[0] > peaks("gpipe", 4)[0]
    one_f_one_b_4, one_f_one_b_8 = peaks("1f1b", 4), peaks("1f1b", 8)
    # only the gradient receive buffers (m of them, kept for good) and the whole batch grow with m under 1F1B
    assert one_f_one_b_8[0] - one_f_one_b_4[0] == 4 * 2 * 32 * 64 * 4 + 4 * 2 * 32 * 8
    assert peaks("gpipe", 8)[0] > one_f_one_b_8[0]


def test_steady_steps_repeat_with_a_pipeline():
    setup = TrainingSetup(micro_batch=2, seq_len=32, world_size=2, pp=2, grad_accum=4, steps=50)
    graph = describe(preset("tiny-llama"), setup, "cpu")
    assert graph.metadata.steps_simulated < 50


# -- against real torch.distributed.pipelining runs --------------------------------------------------------------

def _against_real(name, pp, schedule, m, v=1, n_layer=None):
    import dataclasses

    from peakledger.analysis.validate import compare_logs, static_rows
    from peakledger.traces.pipeline_run import measure_pipeline

    cfg = preset(name) if n_layer is None else dataclasses.replace(preset(name), n_layer=n_layer)
    setup = TrainingSetup(micro_batch=2, seq_len=32, grad_accum=m, steps=2, world_size=pp, pp=pp,
                          pp_schedule=schedule, virtual_stages=v)
    measured = measure_pipeline(cfg, setup)
    simulated = simulate(describe(cfg, setup, "cpu", all_steps=True))
    for rank, log in enumerate(measured):
        assert static_rows(log, rank) == static_rows(simulated, rank)
        val = compare_logs(log, simulated, rank=rank)
        assert val.passes(0.01), (rank, val.overall, val.unexplained)
        assert abs(val.overall.predicted - val.overall.measured) <= 64  # 4-byte scalars apart
    return measured


def test_two_stages_1f1b_match_a_real_run():
    """`validate --pp 2` (validation.validate_ranks): each rank of a real run against its simulated rank."""
    from peakledger import validation
    from peakledger.analysis.validate import static_rows
    from peakledger.scenario import Scenario

    setup = TrainingSetup(micro_batch=2, seq_len=32, grad_accum=4, steps=2, world_size=2, pp=2)
    scenario = Scenario(name="tiny", model=preset("tiny"), setup=setup, device="cpu")
    results, simulated = validation.validate_ranks(scenario)
    assert [log.metadata.stages[0]["index"] for _, log in results] == [0, 1]
    for rank, (val, log) in enumerate(results):
        assert static_rows(log, rank) == static_rows(simulated, rank)
        assert val.passes(0.01) and abs(val.overall.predicted - val.overall.measured) <= 64, val.overall
    first, last = results[0][0].overall, results[-1][0].overall
    assert abs((last.measured - first.measured) - (last.predicted - first.predicted)) <= 64


def test_validate_pipeline_refuses_the_fake_process_group(capsys):
    assert main(["validate", "--pp", "2", "--world-size", "2", "--grad-accum", "2", "--pg-backend", "fake"]) == 2
    assert "pg_backend" in capsys.readouterr().err


@slow
@pytest.mark.parametrize("name, pp, schedule, m, v, n_layer", [
    ("tiny", 4, "gpipe", 4, 1, None), ("tiny", 4, "1f1b", 6, 1, None), ("tiny", 2, "gpipe", 8, 1, None),
    ("tiny-llama", 4, "interleaved-1f1b", 8, 2, 6), ("tiny", 2, "interleaved-1f1b", 4, 2, None)])
def test_more_schedules_match_real_runs(name, pp, schedule, m, v, n_layer):
    _against_real(name, pp, schedule, m, v, n_layer)


# -- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field, words", [
    (dict(pp=2), "pp", "does not divide world_size"),
    (dict(pp=2, world_size=2), "grad_accum", "1f1b needs at least as many micro-batches"),
    (dict(pp=2, world_size=2, grad_accum=2, pp_schedule="bogus"), "pp_schedule", "allowed: gpipe"),
    (dict(pp=2, world_size=2, grad_accum=4, pp_schedule="interleaved-1f1b"), "virtual_stages", ">= 2"),
    (dict(pp=2, world_size=2, grad_accum=4, pp_schedule="zbv", virtual_stages=3), "virtual_stages", "exactly 2"),
    (dict(pp=2, world_size=2, grad_accum=2, virtual_stages=2), "virtual_stages", "one stage per rank"),
    (dict(pp=4, world_size=4, grad_accum=9, pp_schedule="interleaved-1f1b", virtual_stages=2), "grad_accum",
     "number_of_rounds"),
    (dict(tp=2, world_size=3), "tp", "does not divide world_size"),
    (dict(sequence_parallel=True), "sequence_parallel", "needs tp > 1"),
    (dict(ep=2, cp=4, world_size=4), "ep", "dp x cp"),
    (dict(pp=0), "pp", "positive integer"),
])
def test_bad_setups_name_the_field(fields, field, words):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**fields)
    assert e.value.field == field and words in str(e.value)


@pytest.mark.parametrize("model, fields, field, words", [
    ("tiny", dict(tp=3, world_size=3), "tp", "does not divide the model's n_head=4"),
    ("tiny", dict(tp=2, world_size=2, dp_engine="fsdp2", optimizer_offload="states"), "optimizer_offload",
     "not simulated yet"),
    ("tiny", dict(cp=2, world_size=2), "attention", "attention must be sdpa"),  # eager: no SDPA call for CP
    ("tiny-llama", dict(cp=2, tp=2, world_size=8), "world_size", "not simulated yet"),  # cp x tp x dp
    ("tiny", dict(ep=2, world_size=2), "ep", "has none"),
    ("tiny", dict(pp=4, world_size=4, grad_accum=4, pp_schedule="interleaved-1f1b", virtual_stages=2), "pp",
     "n_layer + 2 = 4"),
    ("tiny", dict(pp=2, world_size=2, grad_accum=2, pp_schedule="zbv", virtual_stages=2), "pp_schedule",
     "not simulated yet"),
    ("tiny-mlp", dict(pp=2, world_size=2, grad_accum=2), "pp", "not an MLP"),
    # what pp is not simulated with yet is refused when the model is described (a scenario with it can still be
    # compared with Megatron's and llm-analysis's formulas: compare --peers)
    ("tiny", dict(pp=2, world_size=4, grad_accum=2, zero_stage=2), "zero_stage", "incompatible with pipeline"),
    ("tiny", dict(pp=2, world_size=4, grad_accum=2, dp_engine="ddp"), "dp_engine", "not simulated yet"),
])
def test_bad_setups_for_the_model_name_the_field(model, fields, field, words):
    with pytest.raises(ConfigError) as e:
        build_tape(preset(model), TrainingSetup(micro_batch=2, seq_len=32, **fields), True)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_cli_bad_degrees_exit_2(capsys):
    assert main(["simulate", "--preset", "tiny", "--pp", "2", "--world-size", "2", "--grad-accum", "1"]) == 2
    assert "grad_accum" in capsys.readouterr().err
    assert main(["simulate", "--preset", "tiny", "--pp", "2", "--world-size", "4", "--grad-accum", "2",
                 "--dp-engine", "ddp"]) == 2
    assert "not simulated yet" in capsys.readouterr().err
    assert main(["simulate", "--preset", "tiny", "--pp-schedule", "gpipe"]) == 2  # a knob nothing reads
    assert "pp_schedule" in capsys.readouterr().err


def test_explain_offers_schedules_and_degrees_saying_when_they_take_more_gpus():
    from peakledger import api, diagnosis
    from peakledger.scenario import build_scenario

    sc = build_scenario({"preset": "tiny"}, {"pp": 2, "world_size": 2, "grad_accum": 4, "pp_schedule": "gpipe",
                                             "precision": "fp32", "micro_batch": 8}, {"device": "cpu"})
    gpipe = api.run(sc).peaks.overall.bytes
    fixes = {f.name: f for f in diagnosis.explain(sc, gpipe - 1).fixes}
    one_f_one_b = fixes["pipeline schedule gpipe -> 1f1b"]
    # 1F1B holds at most pp micro-batches' activations on the first stage, GPipe all 4: same GPUs, lower peak
    assert one_f_one_b.peak < gpipe and one_f_one_b.fits and "same GPUs" in one_f_one_b.note
    assert any(name.startswith("pp 2 -> 4 (2 -> 4 GPUs)") and "twice the GPUs" in f.note for name, f in fixes.items())
