"""Optimizer-state offload: the describer against real CPU runs of the reference offload (host buffers
counted as host memory on both sides), and the first-step transient torch's lazy state creation makes."""

import dataclasses

import pytest

from peakledger import api, diagnosis, validation
from peakledger.analysis.report_text import render_text
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.optimizers import offload_chunks
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Action, Category, OptimizerState, Phase, Pool

OFFLOAD_FIELDS = ("optimizer_offload", "offload_chunk_params", "offload_prefetch", "offload_first_step")


def cpu_scenario(preset: str, **training):
    base = dict(precision="fp32", micro_batch=2, steps=3, **({} if preset == "tiny-mlp" else {"seq_len": 32}))
    return build_scenario({"preset": preset}, {**base, **training}, {"device": "cpu"})


def phase_gaps(v, prefixes) -> dict[str, int]:
    return {p.label: p.predicted - p.measured for p in v.phases if p.label.startswith(prefixes)}


def live_before(log, phase: Phase, step: int, pool: Pool = Pool.DEVICE):
    """The blocks of `pool` live just before the first event of (`phase`, `step`) in any pool."""
    first = next(e.seq for e in log.events if e.phase is phase and e.step == step)
    live = {}
    for e in log.events:
        if e.seq >= first:
            break
        if e.block.pool is pool:
            if e.action is Action.ALLOC:
                live[e.block.id] = e.block
            else:
                live.pop(e.block.id)
    return list(live.values())


REAL_CASES = [
    ("tiny-mlp", dict(optimizer_offload="states")),
    ("tiny-mlp", dict(optimizer_offload="chunked", offload_chunk_params=150_000, offload_prefetch=0)),
    ("tiny-mlp", dict(optimizer_offload="chunked", offload_chunk_params=150_000, offload_prefetch=2,
                      offload_first_step="chunked")),
    ("tiny", dict(optimizer_offload="chunked", offload_chunk_params=100_000, optimizer_impl="for-loop")),
    ("tiny", dict(optimizer="sgd-momentum", precision="bf16-autocast", grad_accum=2, optimizer_offload="chunked",
                  offload_chunk_params=100_000, offload_first_step="chunked")),
    ("tiny-llama", dict(optimizer="amsgrad", optimizer_impl="fused", optimizer_offload="chunked",
                        offload_chunk_params=200_000)),
]


@pytest.mark.parametrize("preset, training", REAL_CASES)
def test_offload_matches_a_real_run_to_the_byte(preset, training):
    v, measured, simulated = validation.validate(cpu_scenario(preset, **training))
    assert phase_gaps(v, ("optimizer", "zero_grad")) == dict.fromkeys(phase_gaps(v, ("optimizer", "zero_grad")), 0)
    assert v.host is not None and v.host.measured == v.host.predicted > 0
    # forward and backward keep exactly the gaps the same run has without the offload (it does not touch them)
    plain = {k: v for k, v in training.items() if k not in OFFLOAD_FIELDS}
    v0, _, plain_simulated = validation.validate(cpu_scenario(preset, **plain))
    assert phase_gaps(v, ("load", "forward", "backward")) == phase_gaps(v0, ("load", "forward", "backward"))
    # between steps the device holds no optimizer state but Adam's 4-byte `step` scalars, on both sides,
    # and the host buffers hold the bytes the states take without the offload
    states = sum(b.nbytes for b in live_before(plain_simulated, Phase.FORWARD, 2)
                 if b.category is Category.OPTIMIZER_STATE and b.nbytes > 4)
    for log in (measured, simulated):
        device = [b for b in live_before(log, Phase.FORWARD, 2) if b.category is Category.OPTIMIZER_STATE]
        assert all(b.nbytes == 4 for b in device)
        assert sum(b.nbytes for b in live_before(log, Phase.FORWARD, 2, Pool.HOST)) == states > 0


def test_first_step_above_the_steady_state_on_a_real_run_and_why():
    """A whole first step creates every state on the device before the offload moves any: measured on
    real torch (device memory of a CPU run, host buffers apart), predicted to the byte, and explained."""
    scenario = cpu_scenario("tiny-mlp", optimizer_offload="chunked", offload_chunk_params=150_000)
    v, _, _ = validation.validate(scenario)
    assert v.first_step.measured > v.steady.measured
    assert (v.first_step.predicted, v.steady.predicted) == (v.first_step.measured, v.steady.measured)
    report = api.run(scenario)
    assert report.peaks.first_step.event.phase is Phase.OPTIMIZER and report.peaks.first_step.event.step == 1
    text = render_text(report, "MiB")
    assert "the first step is" in text and "creates every optimizer state lazily" in text
    # chunking the first step too removes the transient, measured as well
    chunked = dataclasses.replace(scenario, setup=scenario.setup.replace(offload_first_step="chunked"))
    vc, _, _ = validation.validate(chunked)
    assert vc.first_step.measured <= vc.steady.measured < v.first_step.measured
    assert (vc.first_step.predicted, vc.steady.predicted) == (vc.first_step.measured, vc.steady.measured)


@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
def test_without_offload_the_first_step_is_never_above_the_steady_state(impl):
    """The states torch creates lazily in step 1 stay for every later step: measured and predicted."""
    v, _, _ = validation.validate(cpu_scenario("tiny-mlp", micro_batch=64, optimizer_impl=impl))
    assert v.steady.measured >= v.first_step.measured
    assert v.steady.predicted >= v.first_step.predicted


def gpu_scenario(**training):
    base = dict(precision="bf16", micro_batch=1, seq_len=256, checkpointing="full", optimizer_offload="chunked")
    chunked = {"offload_chunk_params": 10_000_000} if training.get("optimizer_offload", "chunked") == "chunked" else {}
    return build_scenario({"preset": "gpt2"}, {**base, **chunked, **training})


def test_explain_finds_the_first_step_oom_and_the_chunked_first_step_fixes_it():
    scenario = gpu_scenario()
    report = api.run(scenario)
    pk = report.peaks
    assert pk.first_step.bytes > pk.steady.bytes
    # between the two peaks, plus what the GPU holds besides the tensors at the peak (context, cached blocks)
    budget = (pk.first_step.bytes + pk.steady.bytes) // 2 + report.capacity_needed - pk.overall.bytes
    x = diagnosis.explain(scenario, budget)
    assert x.moment.failed and x.moment.event.step == 1 and x.moment.event.phase is Phase.OPTIMIZER
    fix = next(f for f in x.fixes if f.changes == {"offload_first_step": "chunked"})
    assert fix.fits and not fix.changes_training
    # the same budget without any offload (chunk size kept for the fix): the chunked offload is offered and fits
    plain = diagnosis.explain(scenario.with_changes(optimizer_offload="none"), budget)
    assert any(f.fits and f.changes.get("optimizer_offload") == "chunked" for f in plain.fixes)


def test_offloaded_states_live_on_the_host_between_steps_on_a_gpu():
    report = api.run(gpu_scenario())
    log = report.log
    host = [b for b in live_before(log, Phase.FORWARD, 2, Pool.HOST)
            if b.category is Category.OPTIMIZER_STATE and b.state is not OptimizerState.STEP]
    device = [b for b in live_before(log, Phase.FORWARD, 2) if b.category is Category.OPTIMIZER_STATE]
    assert host and not device  # Adam's `step` scalars are host tensors on a GPU anyway
    plain = api.run(gpu_scenario(optimizer_offload="none")).log
    states = [b for b in live_before(plain, Phase.FORWARD, 2) if b.category is Category.OPTIMIZER_STATE]
    assert sum(b.nbytes for b in host) == sum(b.nbytes for b in states)


def test_chunks_are_consecutive_bounded_and_greedy():
    numels = [5, 5, 5, 20, 1, 3, 9]
    for budget in (1, 6, 10, 15, 100):
        chunks = offload_chunks(numels, "chunked", budget)
        assert [i for c in chunks for i in c] == list(range(len(numels)))
        for k, c in enumerate(chunks):
            size = sum(numels[i] for i in c)
            assert size <= budget or len(c) == 1
            if k + 1 < len(chunks):
                assert size + numels[chunks[k + 1][0]] > budget  # the next tensor did not fit
    assert offload_chunks(numels, "states", 1) == [list(range(len(numels)))]


@pytest.mark.parametrize("changes, field", [
    (dict(optimizer_offload="cpu"), "optimizer_offload"),
    (dict(optimizer_offload="states", optimizer="sgd"), "optimizer_offload"),
    (dict(optimizer_offload="states", optimizer="adam-8bit"), "optimizer_offload"),
    (dict(optimizer_offload="chunked", world_size=8, zero_stage=2), "optimizer_offload"),
    (dict(optimizer_offload="chunked", load_mode="map-to-device"), "load_mode"),
    (dict(optimizer_offload="chunked", world_size=4, dp_engine="fsdp2", save_mode="full-rank0"), "save_mode"),
    (dict(optimizer_offload="states", offload_first_step="chunked"), "offload_first_step"),
    (dict(optimizer_offload="chunked", offload_prefetch=-1), "offload_prefetch"),
    (dict(optimizer_offload="chunked", offload_chunk_params=0), "offload_chunk_params"),
])
def test_bad_offload_settings_name_the_field(changes, field):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**changes)
    assert e.value.field == field


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_data_parallel_ranks_offload_as_simulated(engine):
    """The offload around FSDP2's DTensor states (prime-rl's setting) and DDP's, 2 real ranks on the fake
    process group: every optimizer phase and the host memory exact on each rank, first step above steady."""
    scenario = cpu_scenario("tiny-mlp", world_size=2, dp_engine=engine, optimizer_offload="chunked",
                            offload_chunk_params=40_000)
    results, _ = validation.validate_ranks(scenario, backend="fake")
    for v, _log in results:
        assert phase_gaps(v, ("optimizer",)) == dict.fromkeys(phase_gaps(v, ("optimizer",)), 0)
        assert v.host.measured == v.host.predicted > 0
        assert v.first_step.measured == v.first_step.predicted > v.steady.measured
