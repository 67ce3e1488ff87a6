"""Tensor parallelism (models/parallel/tensor/) against real DTensor runs (traces/tensor_run.py: gloo over
127.0.0.1, one process per tensor-parallel rank, measured with the tracker): static rows exact, every rank's peak
within 1%. The default run measures the tiny GPT at tp=2 without SP (a few seconds); the other cases (SP, the tiny
Llama, tp=4) run with PEAKLEDGER_SLOW=1."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from peakledger.analysis.validate import compare_logs, static_rows
from peakledger.models.config import TrainingSetup
from peakledger.models.parallel.tensor import TensorParallelTape, chunk, tensor_parallel_tape
from peakledger.models.presets import preset
from peakledger.models.training import build_tape, describe
from peakledger.simulator.engine import simulate

SETUP = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2)
slow = pytest.mark.skipif(not os.environ.get("PEAKLEDGER_SLOW"), reason="real multi-process runs: PEAKLEDGER_SLOW=1")


def _tp_tape(name: str, tp: int, sp: bool, rank: int = 0) -> TensorParallelTape:
    return tensor_parallel_tape(build_tape(preset(name), SETUP, cpu=True), tp, sp, rank)


def test_chunk_is_torch_chunk():
    import torch

    for n in (1, 7, 10, 64, 65):
        for tp in (2, 3, 4):
            assert [chunk(n, tp, r) for r in range(tp)] == \
                   [len(c) for c in torch.arange(n).chunk(tp)] + [0] * (tp - len(torch.arange(n).chunk(tp)))


def test_tiny_gpt_shapes_by_hand():
    """tiny: d_model 64, 4 heads of 16, ffn 256, vocab 256, tied; B=2, T=32; tp=2 rank 0."""
    tape = _tp_tape("tiny", 2, False)
    params = {p.name: p.shape for p in tape.params}
    assert params["transformer.wte.weight"] == (128, 64)  # vocab-parallel, shared with lm_head
    assert "lm_head.weight" not in params
    assert params["transformer.wpe.weight"] == (64, 64)  # replicated
    assert params["transformer.h.0.attn.c_attn.weight"] == (96, 64)  # 3 x 64 / 2 rows
    assert params["transformer.h.0.attn.c_attn.bias"] == (96,)
    assert params["transformer.h.0.attn.c_proj.weight"] == (64, 32)  # row-parallel: input columns
    assert params["transformer.h.0.attn.c_proj.bias"] == (64,)
    assert params["transformer.h.0.mlp.c_fc.weight"] == (128, 64)
    assert params["transformer.h.0.mlp.c_proj.weight"] == (64, 128)
    assert params["transformer.h.0.ln_1.weight"] == (64,)
    out = {o.name: o.shape for op in tape.ops for o in op.outputs}
    kinds = {op.name: op.kind for op in tape.ops}
    assert out["transformer.h.0.attn.c_attn.out"] == (2, 32, 96)
    assert out["transformer.h.0.attn.scores"] == (2, 2, 32, 32)  # 2 local heads
    assert out["transformer.h.0.attn.merged"] == (2, 32, 32)
    assert out["transformer.h.0.attn.c_proj.partial"] == (2, 32, 64)
    assert kinds["transformer.h.0.attn.c_proj.all_reduce"] == "all_reduce"
    assert out["transformer.h.0.attn.c_proj.out"] == (2, 32, 64)
    assert out["lm_head.out"] == (2, 32, 128)  # vocab-sharded logits (loss_parallel)
    assert out["loss.log_softmax.out"] == (2, 32, 128)
    assert tape.grad_hooks["transformer.h.0.attn.c_attn"] == (("sum", "transformer.h.0.ln_1.out"),
                                                            ("all_reduce", "transformer.h.0.ln_1.out"))
    assert tape.grad_hooks["lm_head"] == (("all_reduce", "transformer.ln_f.out"),)
    assert tape.grad_shapes == {}  # tied: the embedding's gradient is its rows

    sp = _tp_tape("tiny", 2, True, rank=1)
    out = {o.name: o.shape for op in sp.ops for o in op.outputs}
    kinds = {op.name: op.kind for op in sp.ops}
    assert out["transformer.wte.out"] == (2, 16, 64)  # reduce-scattered on the sequence
    assert out["transformer.wpe.out"] == (16, 64)
    assert out["transformer.h.0.ln_1.out"] == (2, 16, 64)
    assert kinds["transformer.h.0.attn.all_gather"] == "all_gather"
    assert out["transformer.h.0.attn.all_gather.out"] == (2, 32, 64)
    assert out["transformer.h.0.attn.c_proj.out"] == (2, 16, 64)
    assert out["lm_head.all_gather.out"] == (2, 32, 64)

    llama = _tp_tape("tiny-llama", 2, False)
    params = {p.name: p.shape for p in llama.params}
    assert params["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 2 kv heads of 16 over 2 ranks
    assert params["model.layers.0.mlp.down_proj.weight"] == (64, 88)  # ffn 176 / 2
    assert llama.grad_shapes == {"model.embed_tokens.weight": (256, 64)}  # untied: a Replicate (V, D) gradient


def _check(name: str, tp: int, sp: bool, model=None, setup: TrainingSetup = SETUP):
    from peakledger.traces.tensor_run import measure_tensor_parallel

    model = model or preset(name)
    logs = measure_tensor_parallel(model, setup, tp, sp)
    for rank, log in enumerate(logs):
        sim = simulate(describe(model, setup.replace(tp=tp, sequence_parallel=sp, world_size=tp), "cpu", ranks=[rank],
                                all_steps=True))
        assert static_rows(log, rank) == static_rows(sim, rank)
        v = compare_logs(log, sim, rank=rank)
        assert v.passes(0.01), (rank, v.overall, v.unexplained)


def test_tiny_gpt_tp2_matches_dtensor():
    _check("tiny", 2, False)


@slow
@pytest.mark.parametrize("name, tp, sp", [("tiny", 2, True), ("tiny-llama", 2, False), ("tiny-llama", 2, True),
                                          ("tiny", 4, False), ("tiny", 4, True)])
def test_more_cases_match_dtensor(name, tp, sp):
    _check(name, tp, sp)


@slow
@pytest.mark.parametrize("sp", [False, True])
def test_tiny_llama_tp4_matches_dtensor(sp):
    """tiny-llama has 2 kv heads: tp=4 takes its variant with 4 (every rank holds whole heads)."""
    _check("tiny-llama", 4, sp, replace(preset("tiny-llama"), n_kv_head=4))


@slow
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
@pytest.mark.parametrize("name, sp", [("tiny", True), ("tiny-llama", False)])
def test_16_bit_matches_dtensor(precision, name, sp):
    """Pure bf16 (loss_parallel computes 16-bit logits in fp32: the forward's peak) and CPU bf16 autocast."""
    _check(name, 2, sp, setup=SETUP.replace(micro_batch=4, seq_len=64, precision=precision))


@slow
@pytest.mark.parametrize("sp", [False, True])
def test_small_vocabulary_llama(sp):
    """Vocabulary 32, d_model 128: the peak leaves the loss for the norms' backward (the composite RMSNorm's
    temporaries) and the sharded blocks."""
    model = replace(preset("tiny-llama"), name="tiny-llama-v32", vocab_size=32, d_model=128, n_head=8, n_kv_head=4,
                    d_ff=352)
    _check("tiny-llama", 2, sp, model, SETUP.replace(micro_batch=4, seq_len=64))


def test_simulate_and_validate_run_tensor_parallelism_through_the_one_describer(capsys):
    """Wired in: `describe` transforms the tape per rank class (build_tape's tp = 1 tape), and `validate --tp` holds
    every rank of a real DTensor run against it."""
    from peakledger import api, validation
    from peakledger.cli import main
    from peakledger.scenario import build_scenario

    sc = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 32, "precision": "fp32", "tp": 2,
                                             "world_size": 2}, {"device": "cpu"})
    report = api.run(sc)
    assert [list(rp.same_as) for rp in report.ranks] == [[0, 1]] and report.metadata.n_params == 120_576
    results, _ = validation.validate_ranks(sc)
    assert all(abs(v.overall.error) <= 0.01 for v, _ in results)
    assert main(["simulate", "--preset", "tiny-llama", "--tp", "2", "--cp", "2", "--world-size", "8", "--dp-engine",
                 "fsdp2", "--precision", "fp32", "--device", "cpu"]) == 2  # cp x tp x dp: not simulated yet
    assert "world_size" in capsys.readouterr().err


@pytest.mark.parametrize("name, sp", [("tiny", False), ("tiny", True), ("tiny-llama", False), ("tiny-llama", True)])
def test_optimizer_groups_are_the_real_plans(name, sp):
    """The simulated optimizer's parameter groups (DTensors first, then plain tensors, each made and stepped before
    the next) are the groups traces/tensor_run.py `optimizer_groups` builds (one per device mesh, then the plain
    tensors) from the real plan: torchtitan's plan applied by `parallelize` on torch's fake process group (one
    process, tp 2: real DTensor placements; split here by DTensor-ness, as one mesh makes it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from peakledger.models.devices import device_profile
    from peakledger.models.parallel.mesh import rank_builder
    from peakledger.traces.reference import build_model
    from peakledger.traces.tensor_run import parallelize

    setup = SETUP.replace(tp=2, sequence_parallel=sp, world_size=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = parallelize(build_model(preset(name), setup), 2, sp)
        params = list(model.named_parameters())
        real = [g for g in ([n for n, p in params if isinstance(p, DTensor)],
                            [n for n, p in params if not isinstance(p, DTensor)]) if g]
    finally:
        dist.destroy_process_group()
    b = rank_builder(build_tape(preset(name), setup, cpu=True), setup, device_profile("cpu"), 0)
    assert [[t.name for t in g] for g in b.engine.optim_groups()] == real
