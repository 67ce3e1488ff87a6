"""Context parallelism (models/parallel/context.py, ring.py): torch's ring attention walked call by call, against
the allocations a real run recorded (traces/context_run.py: tiny GPT-2, cp 2, rank 0, B 2, T 32, fp32: every
local q / k / v 8,192 B, the logsumexp 128 floats), the context's entry, and a rank's tape."""

from __future__ import annotations

from dataclasses import replace

import pytest

from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.parallel.context import context_entry, context_parallel_tape
from peakledger.models.parallel.ring import ring_backward, ring_forward
from peakledger.models.presets import preset
from peakledger.models.training import build_tape, describe
from peakledger.simulator.engine import simulate

GPT = replace(preset("tiny"), attention="sdpa")
SETUP = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", cp=2, world_size=2)


def test_one_ring_call_peaks_where_torch_recorded_it():
    # recorded: k, v contiguous copies, the k / v cat, the all-gather (2 x 16 KiB), step 0's output and logsumexp
    fwd = ring_forward(0, 2, 8192, 8192, 8192, 128, False, False, 4)
    assert (fwd.peak, fwd.kept) == (74_240, 8_192 + 512)  # kept: the merged output and logsumexp
    # recorded: fp32 accumulators, k / v copies, cat, all-gather, step 0's gradients, flatten copies, the gradient
    # cat and all-to-all, the partial step's logsumexp chunk, then its dq_ (half), dk_, dv_: the call's highest point
    bwd = ring_backward(0, 2, 8192, 8192, 8192, 128, False, False, 4)
    assert (bwd.peak, bwd.kept) == (151_808, 8_192 + 16_384)  # kept: dq, and dk / dv in the last all-to-all


def test_context_entry_matches_the_recorded_entry():
    peak, kept = context_entry(2, 32, 2)
    assert peak == 1_408 and sum(kept) == 1_024  # recorded: +1,408 B transient, 1,024 B held until the exit


def test_a_cp_rank_holds_its_sequence_rows():
    tape = build_tape(GPT, SETUP, True)
    for rank in (0, 1):
        local = context_parallel_tape(tape, 2, rank)
        shapes = {o.name: o.shape for op in local.ops for o in op.outputs}
        assert shapes["transformer.h.0.ln_1.out"] == (2, 16, 64) and shapes["transformer.wpe.out"] == (16, 64)
        assert shapes["transformer.h.0.attn.sdpa.lse"] == (2, 4, 16)
        # every rank but the last merges a partial step by cat: the output's contiguous copy
        assert ("transformer.h.0.attn.sdpa.out.contiguous" in shapes) == (rank == 0)
        assert {p.name: p.shape for p in local.params} == {p.name: p.shape for p in tape.params}


@pytest.mark.parametrize("model, fields, device, field", [
    (preset("tiny"), {}, "cpu", "attention"),  # eager attention: context_parallel replaces SDPA calls only
    (GPT, dict(world_size=4), "cpu", "dp_engine"),  # cp with data parallelism: FSDP2 over dp x cp only
    (GPT, dict(world_size=4, pp=2, grad_accum=2), "cpu", "world_size"),
    (GPT, dict(world_size=8, tp=2, dp_engine="fsdp2"), "cpu", "world_size"),  # cp x tp x dp: not yet
    (GPT, dict(world_size=4, tp=2, sequence_parallel=True), "cpu", "sequence_parallel"),
    (GPT, dict(precision="bf16-mixed"), "cpu", "precision"),
    (GPT, dict(checkpointing="full"), "cpu", "checkpointing"),
    (GPT, {}, "H100-80GB", "device"),
])
def test_what_cp_is_not_simulated_with_names_the_field(model, fields, device, field):
    with pytest.raises(ConfigError) as e:
        describe(model, SETUP.replace(**fields), device)
    assert e.value.field == field


def test_explain_offers_context_parallelism_saying_it_takes_more_gpus():
    from peakledger import api, diagnosis
    from peakledger.scenario import build_scenario

    sc = build_scenario({"preset": "tiny-llama"}, {"precision": "fp32", "micro_batch": 8, "seq_len": 64},
                        {"device": "cpu"})
    peak = api.run(sc).peaks.overall.bytes
    fixes = {f.name: f for f in diagnosis.explain(sc, peak - 1).fixes}
    cp = fixes["cp 1 -> 2 (1 -> 2 GPUs)"]
    assert cp.peak < peak and cp.more_gpus and "twice the GPUs" in cp.note


def test_fsdp2_shards_over_dp_x_cp():
    """With cp, FSDP2 shards the parameters and optimizer states over dp x cp (torchtitan's dp_shard_cp): rank r
    holds what FSDP2 rank r of dp x cp ranks holds without cp (its static rows), whatever its sequence chunk."""
    from peakledger.analysis.validate import static_rows

    cp = SETUP.replace(world_size=4, dp_engine="fsdp2")
    plain = SETUP.replace(cp=1, world_size=4, dp_engine="fsdp2")
    with_cp = simulate(describe(GPT, cp, "cpu", ranks=[0, 1, 2, 3]))
    without = simulate(describe(GPT, plain, "cpu", ranks=[0, 1, 2, 3]))
    for rank in range(4):
        assert static_rows(with_cp, rank) == static_rows(without, rank)
