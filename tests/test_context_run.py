"""traces/context_run.py: real context-parallel runs (torch's `context_parallel`, ring attention, on gloo over
127.0.0.1, one tracked process per cp rank). The argument checks and the CP model's equivalence with the reference
model run always; the real 2- and 4-process runs (10-20 s each on two cores) run with PEAKLEDGER_SLOW=1."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.simulator.events import Action, Category, Phase

slow = pytest.mark.skipif(os.environ.get("PEAKLEDGER_SLOW") != "1",
                          reason="real 2-4 process context-parallel runs (10-20 s each): PEAKLEDGER_SLOW=1 runs them")


def _setup(cp: int, **kw) -> TrainingSetup:
    return TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, world_size=cp, cp=cp, **kw)


# -- always -----------------------------------------------------------------------------------------------

def test_checks():
    from peakledger.traces.context_run import _check

    cfg = preset("tiny")
    _check(cfg, _setup(2), "allgather")
    with pytest.raises(ValueError, match="2 x cp"):
        _check(cfg, _setup(4).replace(seq_len=36), "allgather")
    with pytest.raises(NotImplementedError, match="dp_engine fsdp2"):
        _check(cfg, TrainingSetup(micro_batch=2, seq_len=32, world_size=4, cp=2), "allgather")
    _check(cfg, TrainingSetup(micro_batch=2, seq_len=32, world_size=4, cp=2, dp_engine="fsdp2"), "allgather")
    _check(cfg, TrainingSetup(micro_batch=2, seq_len=32, world_size=4, cp=2, tp=2), "allgather")  # cp x tp
    with pytest.raises(NotImplementedError, match="pp 1"):
        _check(cfg, TrainingSetup(micro_batch=2, seq_len=32, world_size=4, cp=2, pp=2, grad_accum=2), "allgather")
    with pytest.raises(ValueError, match="cp >= 2"):
        _check(cfg, TrainingSetup(micro_batch=2, seq_len=32), "allgather")
    with pytest.raises(ValueError, match="rotate_method"):
        _check(cfg, _setup(2), "ring")
    with pytest.raises(NotImplementedError, match="checkpointing"):
        _check(cfg, _setup(2).replace(checkpointing="full"), "allgather")


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_cp_model_is_the_reference_model(name):
    """Outside `context_parallel`, the CP model (positions from its buffer, SDPA attention) computes the reference
    model's loss and gradients (the reference run with attention="sdpa")."""
    from peakledger.traces.context_run import build_cp_model, run_config
    from peakledger.traces.reference import build_model, make_batch

    setup = _setup(2)
    cfg = preset(name)
    assert run_config(cfg).attention == "sdpa"
    x, y = make_batch(cfg, setup, seed=1)[0]
    ref = build_model(run_config(cfg), setup, seed=0)
    cp = build_cp_model(cfg, setup, seed=0)
    _, ref_loss = ref(x, y)
    _, cp_loss = cp(x, y)
    ref_loss.backward()
    cp_loss.backward()
    assert torch.equal(ref_loss, cp_loss)
    for (n, p), (m, q) in zip(ref.named_parameters(), cp.named_parameters()):
        assert n == m and torch.equal(p.grad, q.grad), n
    buffers = dict(cp.named_buffers())
    key = "cp_positions" if name == "tiny" else "model.cp_positions"
    assert torch.equal(buffers[key], torch.arange(32))


# -- real runs ----------------------------------------------------------------------------------------------

def _param_bytes(cfg, setup) -> int:
    from peakledger.traces.context_run import build_cp_model

    return sum(p.numel() * p.element_size() for p in build_cp_model(cfg, setup).parameters())


def _state_bytes(cfg, setup) -> int:
    """Optimizer-state bytes of the whole model after one step (what each cp rank holds: parameters replicated)."""
    from peakledger.traces.context_run import build_cp_model
    from peakledger.traces.reference import make_batch, torch_optimizer

    model = build_cp_model(cfg, setup)
    opt = torch_optimizer(model.parameters(), setup)
    model(*make_batch(cfg, setup, seed=1)[0])[1].backward()
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _live_after(log, phase: Phase, step: int) -> dict[Category, int]:
    from peakledger.traces.tracker import live_bytes

    last = max(i for i, e in enumerate(log.events) if e.phase is phase and e.step == step)
    return live_bytes(log, last)


def _allocs(log, phase: Phase, step: int, suffix: str) -> list:
    return [e.block for e in log.events if e.action is Action.ALLOC and e.phase is phase and e.step == step
            and e.block.name.endswith(suffix)]


def _check_run(name: str, cp: int, rotate_method: str = "allgather"):
    from peakledger.traces.context_run import measure_context_parallel, reference_losses
    from peakledger.traces.tracker import peak

    cfg, setup = preset(name), _setup(cp)
    logs = measure_context_parallel(cfg, setup, rotate_method=rotate_method)
    assert len(logs) == cp
    params, states = _param_bytes(cfg, setup), _state_bytes(cfg, setup)
    n_kv, hd, B, T = cfg.kv_heads, cfg.head_size, setup.batch.micro_batch, setup.batch.seq_len
    kv_bytes = 2 * B * n_kv * (T // cp) * hd * 4  # this rank's k and v, concatenated (fp32)
    for r, log in enumerate(logs):
        md = log.metadata
        assert (md.rank, md.cp_rank, md.cp, md.world_size) == (r, r, cp, cp)
        assert md.cp_options == {"rotate_method": rotate_method, "enable_load_balance": True,
                                    "convert_to_f32": True}
        assert md.load_balancer == "_HeadTailLoadBalancer" and md.attention == "sdpa"
        assert {e.block.rank for e in log.events} == {r}
        # replicated: the whole model's parameters, gradients and optimizer states on every rank
        live = _live_after(log, Phase.OPTIMIZER, 1)
        assert live[Category.PARAMETER] == params
        assert live[Category.GRADIENT] == params
        assert live[Category.OPTIMIZER_STATE] == states
        # the ring attention's k / v rotation: the local k and v concatenated, then all-gathered once per call in
        # forward (allgather) or sent on cp - 1 times (alltoall); in backward k / v again, and the k / v
        # gradients (fp32) rotated by all-to-all once per ring step
        cats = [b for b in _allocs(log, Phase.FORWARD, 1, "attn.cat") if b.shape == (kv_bytes // 4,)]
        assert len(cats) == cfg.n_layer * (cp - 1), name
        if rotate_method == "allgather":
            gathered = _allocs(log, Phase.FORWARD, 1, "_c10d_functional.all_gather_into_tensor")
            assert [b.nbytes for b in gathered] == [cp * kv_bytes] * cfg.n_layer
        else:
            sent = _allocs(log, Phase.FORWARD, 1, "_c10d_functional.all_to_all_single")
            assert [b.nbytes for b in sent] == [kv_bytes] * (cfg.n_layer * (cp - 1))
        dkv = _allocs(log, Phase.BACKWARD, 1, "_c10d_functional.all_to_all_single")
        assert len(dkv) >= cfg.n_layer * cp and {b.nbytes for b in dkv} == {kv_bytes}
        nbytes, _ = peak(log)
        assert params + states < nbytes < 10 * (params + states)
    # ring attention is exact and the averaged gradients make every step a whole-sequence step
    ref = reference_losses(cfg, setup)
    for i, (step, mb, loss) in enumerate(ref):
        ranks = [log.metadata.losses[i] for log in logs]
        assert all(x[:2] == [step, mb] and math.isfinite(x[2]) for x in ranks)
        assert sum(x[2] for x in ranks) / cp == pytest.approx(loss, abs=1e-5)
    return logs


@slow
def test_tiny_gpt_cp2():
    logs = _check_run("tiny", 2)
    # context_parallel's entry (load balancer indices, reordered and sharded buffers, the position buffer's copy
    # to restore) allocates in FORWARD, and everything it keeps is freed by its exit, in that micro-batch's BACKWARD
    for log in logs:
        enter = [e for e in log.events if e.block.name.startswith("context_parallel.enter") and e.step == 1]
        allocs = [e for e in enter if e.action is Action.ALLOC]
        assert allocs and all(e.phase is Phase.FORWARD for e in allocs)
        assert len(allocs) == len([e for e in enter if e.action is Action.FREE])
        assert any(e.block.shape == (32,) and e.block.dtype == "int64" for e in allocs)  # the restore copy


@slow
def test_tiny_llama_cp2():
    _check_run("tiny-llama", 2)


@slow
def test_tiny_gpt_cp4():
    _check_run("tiny", 4)


@slow
def test_tiny_gpt_cp2_alltoall():
    _check_run("tiny", 2, rotate_method="alltoall")


@slow
@pytest.mark.parametrize("name, world", [("tiny", 4), ("tiny-llama", 4), ("tiny", 2)])
def test_fsdp2_over_dp_x_cp_matches_the_simulation(name, world):
    """FSDP2 over torchtitan's dp_shard_cp (dp x cp flattened) with context parallelism: every rank's peak within
    8 bytes of the simulation (the 4-byte ones_like of the loss backward and a 4-byte scalar, unmodelled), static
    rows exact, and the parameters sharded over dp x cp."""
    from peakledger.analysis.validate import compare_logs, static_rows
    from peakledger.models.training import describe
    from peakledger.simulator.engine import simulate
    from peakledger.traces.context_run import measure_context_parallel
    from peakledger.traces.distributed import without_backend_copies

    cfg = replace(preset(name), attention="sdpa")
    setup = _setup(2).replace(world_size=world, dp_engine="fsdp2")
    measured = [without_backend_copies(log) for log in measure_context_parallel(cfg, setup)]
    simulated = simulate(describe(cfg, setup, "cpu", ranks=list(range(world)), all_steps=True))
    whole = _param_bytes(cfg, setup)
    for rank, log in enumerate(measured):
        assert log.metadata.fsdp_mesh == "dp_shard_cp" and log.metadata.dp_rank == rank // 2
        v = compare_logs(log, simulated, rank=rank)
        assert 0 <= v.overall.measured - v.overall.predicted <= 8, v.overall
        assert static_rows(log, rank) == static_rows(simulated, rank)
        assert _live_after(log, Phase.OPTIMIZER, 1)[Category.PARAMETER] < whole  # a shard, not the whole model


@slow
@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_cp_x_tp_matches_the_simulation(name):
    """Context parallelism over tensor-parallel ranks (mesh (cp, tp), DTensor plan on "tp", no SP): every rank's
    peak and every optimizer phase (two parameter groups: the DTensors, then the plain tensors) as simulated."""
    from peakledger.analysis.validate import compare_logs, static_rows
    from peakledger.models.training import describe
    from peakledger.simulator.engine import simulate
    from peakledger.traces.context_run import measure_context_parallel

    cfg = replace(preset(name), attention="sdpa")
    setup = _setup(2).replace(tp=2, world_size=4)
    measured = measure_context_parallel(cfg, setup)
    simulated = simulate(describe(cfg, setup, "cpu", ranks=list(range(4)), all_steps=True))
    for rank, log in enumerate(measured):
        assert (log.metadata.cp_rank, log.metadata.tp) == (rank // 2, 2)
        v = compare_logs(log, simulated, rank=rank)
        assert v.passes(0.01), (rank, v.overall, v.unexplained[:3])
        assert all(p.measured == p.predicted for p in v.phases if p.label.startswith("optimizer")), v.phases
        assert static_rows(log, rank) == static_rows(simulated, rank)
