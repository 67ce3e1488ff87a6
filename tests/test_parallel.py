"""Data-parallel engines in the simulator: layouts, published figures, per-rank reports, bad input."""

from __future__ import annotations

import json

import pytest

from peakledger.analysis.peers import (
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    model_state_peak,
    zero_paper_model_states,
)
from peakledger.analysis.report import report_json, summarize
from peakledger.cli import main
from peakledger.models.config import ConfigError, MLPConfig, TrainingSetup
from peakledger.models.parallel import dim0_shard, flat_partition, greedy_partition, sub_groups
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category, Stream

# ZeRO paper (Rajbhandari et al. 2020), figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (K = 12),
# model-state memory per device in GB as printed there.
ZERO_PAPER_GB = {0: "120", 1: "31.4", 2: "16.6", 3: "1.88"}
PAPER_MODEL = MLPConfig(name="zero-paper-7.5b", d_in=50_000, hidden=(50_000, 50_000), d_out=50_000, bias=False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_figures(stage):
    assert sum(50_000 * 50_000 for _ in range(3)) == 7_500_000_000
    setup = TrainingSetup(micro_batch=1, seq_len=1, steps=1, precision="bf16-mixed", optimizer="adam",
                          world_size=64, zero_stage=stage)
    states = model_state_peak(simulate(describe(PAPER_MODEL, setup)))
    assert f"{states / 1e9:.3g}" == ZERO_PAPER_GB[stage]
    assert states == zero_paper_model_states(7_500_000_000, 64, stage)  # no padding: 2.5e9 divides by 2 x 64


def test_deepspeed_estimators_leave_out_what_the_simulation_counts():
    cfg = preset("tiny")
    setup = dict(micro_batch=2, seq_len=32, precision="bf16-mixed", world_size=4,
                 stage3_param_persistence_threshold=0, reduce_bucket_size=10_000)
    log2 = simulate(describe(cfg, TrainingSetup(zero_stage=2, **setup), "cpu"))
    report = summarize(log2)
    psi = report.metadata.n_params
    # deepspeed/runtime/zero/stage_1_and_2.py 0.19.8: 2 P + int(18 P / N)
    assert deepspeed_zero2_estimate(psi, 4) == 2 * psi + 18 * psi // 4
    # the formula's fp32 gradient partition (4 P / N) is not a model state in stage 2: a temporary of the step
    assert model_state_peak(log2) < deepspeed_zero2_estimate(psi, 4)
    assert report.peaks.overall.bytes > model_state_peak(log2)
    assert deepspeed_zero3_estimate(psi, 10, 4) == 40 + int(18 * psi / 4)


def test_layouts():
    # FSDP2: every rank stores ceil(rows / N) rows; the local shards add up to the tensor
    shape = (10, 3)
    for n in (1, 2, 3, 4, 16):
        padded = {dim0_shard(shape, n, r)[0] for r in range(n)}
        assert padded == {-(-10 // n) * 3}
        assert sum(dim0_shard(shape, n, r)[1] for r in range(n)) == 30
    # DeepSpeed: flat buffer padded to a multiple of 2N, equal partitions
    assert flat_partition(101, 4) == (104, 26)
    # ZeroRedundancyOptimizer: largest first, to the emptiest rank (the lowest on ties)
    assert greedy_partition([("a", 5), ("b", 9), ("c", 4), ("d", 4)], 2) == [["b", "d"], ["a", "c"]]
    assert sub_groups([6, 6, 3, 20], size=10) == [6, 9, 20]


def test_symmetric_engines_simulate_one_rank_and_uneven_fsdp2_all_classes():
    cfg = preset("tiny")  # vocab 256, max_seq_len 64, d_model 64: 3 does not divide 64 rows
    ds = describe(cfg, TrainingSetup(micro_batch=1, seq_len=8, world_size=8, zero_stage=3), "cpu")
    assert ds.metadata.rank_classes == {"0": list(range(8))}
    fsdp = describe(cfg, TrainingSetup(micro_batch=1, seq_len=8, world_size=3, dp_engine="fsdp2"), "cpu")
    classes = fsdp.metadata.rank_classes
    assert sorted(r for members in classes.values() for r in members) == [0, 1, 2] and len(classes) > 1
    report = summarize(simulate(fsdp))
    assert {rp.rank for rp in report.ranks} == {int(r) for r in classes}
    assert report.peaks.overall.bytes == max(rp.peak.bytes for rp in report.ranks)


def test_fsdp2_gathers_are_transient_and_on_the_communication_stream():
    graph = describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=32, world_size=2, precision="fp32",
                                                   dp_engine="fsdp2"), "H100-80GB")
    comm = [op for op in graph.ops_in_order() if op.stream is Stream.COMMUNICATION]
    assert {op.name.split(".")[1] for op in comm} == {"all_gather", "reduce_scatter"}
    assert all(op.duration > 0 for op in comm)
    log = simulate(graph)
    gathers = [e for e in log.events if e.block.category is Category.ALL_GATHER_BUFFER]
    assert {e.action.value for e in gathers} == {"alloc", "free"}
    unsharded = [e for e in log.events if e.block.name.endswith(".unsharded")]
    assert unsharded and {e.action.value for e in unsharded} == {"alloc", "free"}
    sharded = {e.block.name: e.block for e in log.events if e.block.category is Category.PARAMETER
               and not e.block.name.endswith(".unsharded")}
    assert all(b.shard_factor == 2 for b in sharded.values())


def test_llama_70b_zero3_json_has_gather_buffers_at_the_peak(capsys):
    assert main(["simulate", "--preset", "llama-3-70b", "--world-size", "64", "--zero-stage", "3",
                 "--seq-len", "1024", "--micro-batch", "1", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak"]["live_by_category"].get("all_gather_buffer", 0) > 0
    shards = {row["row"]: row["shard_factor"] for row in out["ledger"]}
    assert shards["master_parameter"] == 64 and shards["optimizer_state.exp_avg"] == 64
    assert out["ranks"][0]["ranks"] == list(range(64))


def test_compare_peers_prints_both_peers(capsys):
    assert main(["compare", "--preset", "tiny", "--world-size", "4", "--seq-len", "16", "--micro-batch", "1",
                 "--peers", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in out["peers"]}
    assert set(stages) == {0, 1, 2, 3}
    assert stages[2]["deepspeed_estimate"] and stages[3]["deepspeed_estimate"] and stages[0]["zero_paper"]
    assert stages[3]["model_states"] < stages[0]["model_states"]


@pytest.mark.parametrize("changes, field", [
    (dict(dp_engine="fsdp2", zero_stage=3), "zero_stage"),
    (dict(dp_engine="megatron"), "dp_engine"),
    (dict(backward_prefetch=-1), "backward_prefetch"),
    (dict(reduce_bucket_size=0), "reduce_bucket_size"),
    (dict(reshard_after_forward="yes"), "reshard_after_forward"),
])
def test_bad_parallel_settings_name_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        TrainingSetup(**changes)
    assert err.value.field == field


def test_same_input_same_output_for_every_engine():
    for engine, extra in [("fsdp2", {}), ("ddp", {}), ("zero-redundancy-optimizer", {}),
                          ("deepspeed", {"zero_stage": 3})]:
        setup = TrainingSetup(micro_batch=1, seq_len=8, world_size=3, dp_engine=engine, **extra)
        a = report_json(summarize(simulate(describe(preset("tiny-llama"), setup))))
        b = report_json(summarize(simulate(describe(preset("tiny-llama"), setup))))
        assert json.dumps(a) == json.dumps(b)
