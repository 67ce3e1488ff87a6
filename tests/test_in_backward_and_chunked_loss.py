"""Optimizer-in-backward (`--optimizer-in-backward`, torchtune 0.6.1 `register_optim_in_bwd_hooks`): the simulation
held against the real CPU program (one optimizer per parameter, stepped and zeroed by its post-accumulate-grad
hook) measured by the allocation tracker; and the refusals torchtune's recipes make."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from peakledger import build_scenario
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.simulator.events import Category, Phase
from peakledger.validation import validate

TRAINING = dict(micro_batch=2, seq_len=32, steps=3, precision="fp32", optimizer="adamw")


def _validate(**changes):
    return validate(build_scenario({"preset": "tiny"}, dict(TRAINING, **changes), {"device": "cpu"}))


def _gaps(v, prefix: str) -> dict[str, int]:
    return {p.label: p.predicted - p.measured for p in v.phases if p.label.startswith(prefix)}


def _live(log, category: Category, phase: Phase, step: int) -> int:
    """Bytes of `category` live right after the last event of `phase` in `step`."""
    running, last = 0, None
    for e in log.events:
        if e.block.category is category:
            running += e.delta
        if e.phase is phase and e.step == step:
            last = running
    return last


def _made_in(log, category: Category, phase: Phase, step: int) -> int:
    return sum(e.delta for e in log.events if e.block.category is category and e.phase is phase and e.step == step
               and e.delta > 0)


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_in_backward_matches_the_real_hooked_run(impl):
    plain, _, _ = _validate(optimizer_impl=impl)
    v, measured, simulated = _validate(optimizer_impl=impl, optimizer_in_backward=True)
    # the in-backward ops add no error: each backward phase is off by what the same run without them is off
    assert _gaps(v, "backward") == _gaps(plain, "backward")
    assert _gaps(v, "forward") == _gaps(plain, "forward") == {f"forward step {s}": 0 for s in (1, 2, 3)}
    assert abs(v.overall.error) <= 0.005
    # the real run: states made by each parameter's first hook, in step 1's backward; every gradient freed
    # before backward ends; nothing left for an optimizer phase
    states = _made_in(measured, Category.OPTIMIZER_STATE, Phase.BACKWARD, 1)
    assert states > 0 and _made_in(simulated, Category.OPTIMIZER_STATE, Phase.BACKWARD, 1) == states
    for step in (1, 2, 3):
        assert _live(measured, Category.GRADIENT, Phase.BACKWARD, step) == 0
        assert _live(simulated, Category.GRADIENT, Phase.BACKWARD, step) == 0
    assert not [e for e in measured.events if e.phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD)]
    assert not [e for e in simulated.events if e.phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD)]


def test_bias_before_weight_matches_the_real_run():
    """tiny-mlp (biased linears): the bias's hook runs before the weight's, as the real run shows."""
    mlp = dict(micro_batch=2, steps=2, precision="fp32")
    plain, _, _ = validate(build_scenario({"preset": "tiny-mlp"}, mlp, {"device": "cpu"}))
    v, _, _ = validate(build_scenario({"preset": "tiny-mlp"}, dict(mlp, optimizer_in_backward=True), {"device": "cpu"}))
    assert _gaps(v, "backward") == _gaps(plain, "backward")


@pytest.mark.parametrize("changes, knob", [
    (dict(grad_accum=2, optimizer_in_backward=True), "grad_accum"),
    (dict(loop="hf-trainer", optimizer_in_backward=True), "loop"),
    (dict(precision="bf16-mixed", optimizer_in_backward=True), "precision"),
    (dict(optimizer_offload="states", optimizer_in_backward=True), "optimizer_offload"),
])
def test_refused_as_torchtune_refuses(changes, knob):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**changes)
    assert e.value.field == knob


def test_cli_refuses_grad_accum_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "peakledger.cli", "simulate", "--preset", "tiny", "--grad-accum", "2",
                        "--optimizer-in-backward"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "grad_accum" in r.stderr and "optimizer_in_backward" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- chunked cross-entropy (`--chunked-loss N`): torchtune 0.6.1's chunked_output + CEWithChunkedOutputLoss ---------

needs_torchtune = pytest.mark.skipif(importlib.util.find_spec("torchtune") is None,
                                     reason="the real chunked loss is torchtune's: pip install --no-deps "
                                            "torchtune==0.6.1")


@needs_torchtune
@pytest.mark.parametrize("preset, precision, micro_batch, chunks", [
    ("tiny", "fp32", 2, 4), ("tiny", "bf16", 2, 4), ("tiny-llama", "bf16", 1, 4), ("tiny-llama", "fp32", 2, 8)])
def test_chunked_loss_matches_torchtunes_own_loss(preset, precision, micro_batch, chunks):
    """The real run uses torchtune's own CEWithChunkedOutputLoss class; every forward phase is exact and each
    backward phase is off by the loss scalar and its seed gradient alone (8 B)."""
    training = dict(micro_batch=micro_batch, seq_len=32, steps=2, precision=precision, chunked_loss=chunks)
    v, measured, _ = validate(build_scenario({"preset": preset}, training, {"device": "cpu"}))
    assert _gaps(v, "forward") == {"forward step 1": 0, "forward step 2": 0}
    assert set(_gaps(v, "backward").values()) == {-8}
    # the real run saves one fp32 log_softmax output per chunk, all alive when the forward ends
    vocab = 256
    lsm = [e for e in measured.events if e.step == 2 and e.phase is Phase.FORWARD and e.delta > 0
           and e.block.name.endswith("_log_softmax")]
    assert [e.delta for e in lsm] == [micro_batch * 32 // chunks * vocab * 4] * chunks


@needs_torchtune
def test_chunked_loss_composes_with_optimizer_in_backward():
    training = dict(micro_batch=2, seq_len=32, steps=2, precision="bf16", chunked_loss=4)
    v, _, _ = validate(build_scenario({"preset": "tiny"}, dict(training, optimizer_in_backward=True),
                                      {"device": "cpu"}))
    assert _gaps(v, "forward") == {"forward step 1": 0, "forward step 2": 0}
    assert set(_gaps(v, "backward").values()) == {-8}


@pytest.mark.parametrize("value", [-1, 5, True])
def test_chunked_loss_refuses_bad_values(value):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(seq_len=32, chunked_loss=value)
    assert e.value.field == "chunked_loss"


def test_chunked_loss_refuses_autocast_by_name():
    with pytest.raises(ConfigError) as e:
        TrainingSetup(seq_len=32, chunked_loss=4, precision="bf16-autocast")
    assert e.value.field == "precision"


def test_explain_offers_both_as_fixes_where_they_apply():
    from peakledger.fixes import candidate_fixes

    changes = [c[1] for c in candidate_fixes(build_scenario({"preset": "tiny"}, dict(seq_len=32)))]
    assert {"optimizer_in_backward": True} in changes and {"chunked_loss": 8} in changes
    accumulating = [c[1] for c in candidate_fixes(build_scenario({"preset": "tiny"}, dict(seq_len=32, grad_accum=2)))]
    assert {"optimizer_in_backward": True} not in accumulating  # torchtune refuses accumulation with it
