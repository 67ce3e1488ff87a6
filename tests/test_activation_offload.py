"""Activation offload (`--activation-offload none|save-on-cpu|streams`): the knob, torch's save_on_cpu on a CPU-only
build, and torchtune 0.6.1's OffloadActivations run for real (its own file: traces/reference/offload_streams.py)
against the simulation (models/replay/offload_streams.py). Truths come from the real runs (the tracker) and from
the library's own objects (its tracker dict, its forward stash, its ValueError)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from peakledger import build_scenario
from peakledger.analysis.checkpointing import simulate_run
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.simulator.events import Action, Phase, Pool
from peakledger.traces.tracker import AllocationTracker
from peakledger.validation import validate

TRAINING = dict(micro_batch=4, seq_len=64, steps=2, optimizer="adamw", precision="fp32")


def scenario(mode="streams", preset="tiny", device="cpu", **knobs):
    return build_scenario({"preset": preset, "attention": "eager", "n_layer": 2},
                          {**TRAINING, "activation_offload": mode, **knobs}, {"device": device})


def torchtune_module():
    from peakledger.traces.reference import offload_streams
    if offload_streams.torchtune_file() is None:
        pytest.skip("torchtune is not installed")
    return offload_streams.load()


# -- the knob ----------------------------------------------------------------------------------------

def test_an_unknown_mode_names_the_knob_and_the_allowed_values():
    with pytest.raises(ConfigError) as e:
        TrainingSetup(activation_offload="gpu-direct")
    assert e.value.field == "activation_offload"
    assert all(m in str(e.value) for m in ("none", "save-on-cpu", "streams"))


@pytest.mark.parametrize("knobs, field", [
    (dict(activation_offload="streams", checkpointing="full"), "checkpointing"),
    (dict(activation_offload="save-on-cpu", checkpointing="sqrt"), "activation_offload"),
    (dict(activation_offload="streams", activation_offload_stash=0), "activation_offload_stash"),
    (dict(activation_offload_stash=3), "activation_offload_stash"),
    (dict(activation_offload="streams", activation_offload_min_bytes=-1), "activation_offload_min_bytes"),
])
def test_combinations_not_modelled_name_their_knob(knobs, field):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**knobs)
    assert e.value.field == field


def test_torchtune_itself_refuses_a_forward_stash_under_one():
    mod = torchtune_module()
    with pytest.raises(ValueError, match="max_fwd_stash_size"):
        mod.OffloadActivations(use_pin_memory=False, use_streams=True, max_fwd_stash_size=0)


def test_the_cli_flag_runs_and_a_bad_value_exits_2_with_one_line():
    base = [sys.executable, "-m", "peakledger.cli", "simulate", "--preset", "tiny", "--n-layer", "2", "--micro-batch",
            "2", "--seq-len", "32", "--steps", "1", "--device", "cpu"]
    ok = subprocess.run(base + ["--activation-offload", "streams"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["--activation-offload", "stream"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "activation_offload" in bad.stderr and "streams" in bad.stderr


def test_save_on_cpu_is_checkpointing_offload():
    a = simulate_run(scenario("save-on-cpu")).log
    b = simulate_run(build_scenario({"preset": "tiny", "attention": "eager", "n_layer": 2},
                                    {**TRAINING, "checkpointing": "offload"}, {"device": "cpu"})).log
    assert [(e.action, e.block.nbytes, e.op) for e in a.events] == [(e.action, e.block.nbytes, e.op) for e in b.events]


# -- save_on_cpu on a CPU-only torch (torch 2.13 torch/autograd/graph.py) --------------------------------

def _forward_allocations(hooks) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    with AllocationTracker(model) as tr:
        with tr.phase(Phase.FORWARD, 1, 0), hooks:
            model(x).sum().backward()
    return sum(1 for e in tr.log().events if e.phase is Phase.FORWARD and e.action is Action.ALLOC)


def test_save_on_cpu_copies_every_saved_tensor_only_with_pin_memory_on_a_cpu():
    saved = []
    counting = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t)
    plain = _forward_allocations(counting)
    assert _forward_allocations(torch.autograd.graph.save_on_cpu(pin_memory=False)) == plain  # tensor.cpu() is itself
    # pin_memory=True: torch.empty(..., pin_memory=False here) + copy_ per saved tensor, Parameters included
    assert _forward_allocations(torch.autograd.graph.save_on_cpu(pin_memory=True)) == plain + len(saved)
    assert torch.Size([64]) in saved  # the LayerNorm's weight and bias are packed too


# -- torchtune's OffloadActivations: the library's own objects ---------------------------------------------

def test_torchtune_offloads_a_linears_weight_view_and_keeps_parameters_and_small_tensors():
    mod = torchtune_module()
    ctx = mod.OffloadActivations(use_pin_memory=False, use_streams=True, max_fwd_stash_size=2, min_offload_size=1024)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    with ctx:
        y = model(torch.randn(32, 64, requires_grad=True))
    entries = {tuple(t.shape): (modified, isinstance(t, torch.nn.Parameter)) for t, modified in ctx.tracker.values()}
    assert entries[(64, 64)] == (True, False)  # weight.t(): a view, no Parameter, 16 KiB: offloaded
    assert entries[(64,)] == (False, True)  # LayerNorm weight / bias: Parameters, kept as they are
    assert entries[(32, 1)] == (False, False)  # mean / rstd: 128 B < min_offload_size
    y.sum().backward()
    assert not ctx.tracker and not ctx.fwd_stash and not ctx.bwd_tensor_stash  # the end-of-backward callback


def _host_copies(log, measured: bool):
    ends = (".empty_like",) if measured else (".offloaded",)
    return [e.block.nbytes for e in log.events if e.action is Action.ALLOC and e.block.name.endswith(ends)]


@pytest.mark.parametrize("preset, stash, min_bytes", [("tiny", 5, 1024), ("tiny-llama", 5, 1024), ("tiny", 1, 1024),
                                                      ("tiny", 5, 65537)])
def test_streams_real_cpu_run_against_the_simulation(preset, stash, min_bytes):
    torchtune_module()
    v, measured, simulated = validate(scenario(preset=preset, activation_offload_stash=stash,
                                               activation_offload_min_bytes=min_bytes))
    # the tracker's 8 B: Python scalars torch wraps outside dispatch (traces/tracker/)
    assert 0 <= v.overall.measured - v.overall.predicted <= 8
    assert sorted(_host_copies(measured, True)) == sorted(_host_copies(simulated, False))
    if preset == "tiny":  # the pack hook's order (autograd's SavedVariables, models/replay/offload_streams.py); the
        # llama tape runs up_proj before the SiLU, the program after it (bench/VALIDATION.md)
        def first_forward(log, end):
            return [e.block.nbytes for e in log.events if e.step == 1 and e.phase is Phase.FORWARD
                    and e.action is Action.ALLOC and e.block.name.endswith(end)]
        assert first_forward(measured, ".empty_like") == first_forward(simulated, ".offloaded")


def test_one_forward_host_copies_are_the_bytes_torchtune_holds():
    """After one forward of the reference model, torchtune's own tracker holds the host copies (entries marked
    modified) and its fwd_stash at most max_fwd_stash_size device tensors; the simulated forward makes the same."""
    mod = torchtune_module()
    from peakledger.traces.reference.build import build_model, make_batch
    sc = scenario(activation_offload_stash=5)
    model = build_model(sc.model, sc.setup)
    ctx, _ = model.offload_streams
    idx, targets = make_batch(sc.model, sc.setup)[0]
    _, loss = model(idx, targets)
    host = sorted(t.nbytes for t, modified in ctx.tracker.values() if modified)
    assert isinstance(ctx, mod.OffloadActivations) and 1 <= len(ctx.fwd_stash) <= 5
    loss.backward()
    sim = simulate_run(sc).log
    assert host == sorted(e.block.nbytes for e in sim.events if e.step == 1 and e.phase is Phase.FORWARD
                          and e.action is Action.ALLOC and e.block.name.endswith(".offloaded"))


# -- a GPU profile -----------------------------------------------------------------------------------

def test_on_a_gpu_the_host_copies_are_host_rows_and_stashed_tensors_come_back_without_a_copy():
    run = simulate_run(scenario(device="H100-80GB", activation_offload_stash=5))
    allocs = [e for e in run.log.events if e.action is Action.ALLOC]
    host = [e for e in allocs if e.block.name.endswith(".offloaded")]
    back = [e for e in allocs if e.block.name.endswith(".reloaded")]
    assert host and all(e.block.pool is Pool.HOST for e in host)
    assert back and all(e.block.pool is Pool.DEVICE for e in back)
    per_step = len([e for e in host if e.step == 1])
    reloaded = len([e for e in back if e.step == 1])
    assert 1 <= per_step - reloaded <= 5  # those still in the forward stash are handed back as they are


def test_explain_offers_streams_as_a_fix_where_it_is_modelled():
    from peakledger.fixes import activation_fixes
    names = lambda sc: [c[0] for c in activation_fixes(sc)]  # noqa: E731
    plain = build_scenario({"preset": "tiny", "n_layer": 2}, dict(TRAINING), {"device": "H100-80GB"})
    assert "activation_offload=streams" in names(plain)
    assert "activation_offload=streams" not in names(scenario("streams", device="H100-80GB"))
    full = build_scenario({"preset": "tiny", "n_layer": 2}, {**TRAINING, "checkpointing": "full"}, {"device": "cpu"})
    assert "activation_offload=streams" not in names(full)


def test_the_checkpointing_table_gets_a_streams_row():
    from peakledger.analysis.checkpointing import policy_table
    plain = build_scenario({"preset": "tiny", "n_layer": 2}, dict(TRAINING), {"device": "H100-80GB"})
    rows = {r.policy: r for r in policy_table(plain, policies=("none", "offload"), with_compile=False,
                                              with_streams=True)}
    assert rows["streams"].error is None and rows["streams"].host_activations > 0 == rows["none"].host_activations
    assert rows["streams"].peak < rows["none"].peak
