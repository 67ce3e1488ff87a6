"""Properties of any simulated run (hypothesis): no negative occupancy, nothing leaked, peak >= steady,
and the same input always gives the same output."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peakledger.analysis.report import report_json, summarize
from peakledger.models.config import DP_ENGINES, MLPConfig, TrainingSetup, TransformerConfig
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category
from peakledger.simulator.timeline import timeline

PERSISTENT = {Category.PARAMETER, Category.BUFFER, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE}


@st.composite
def scenarios(draw):
    if draw(st.booleans()):
        heads = draw(st.sampled_from([1, 2, 4]))
        model = TransformerConfig(name="h", architecture=draw(st.sampled_from(["gpt2", "llama"])),
                                  n_layer=draw(st.integers(1, 3)), d_model=heads * draw(st.sampled_from([4, 8])),
                                  n_head=heads, n_kv_head=draw(st.sampled_from([None, 1])),
                                  vocab_size=draw(st.integers(5, 50)), max_seq_len=16,
                                  attention=draw(st.sampled_from(["eager", "sdpa"])),
                                  dropout=draw(st.sampled_from([0.0, 0.1])))
    else:
        model = MLPConfig(name="m", d_in=draw(st.integers(1, 16)),
                          hidden=tuple(draw(st.lists(st.integers(1, 16), min_size=1, max_size=3))),
                          d_out=draw(st.integers(1, 16)))
    precision = draw(st.sampled_from(["fp32", "bf16-mixed", "bf16-autocast", "bf16"]))
    engine = draw(st.sampled_from(DP_ENGINES))
    setup = TrainingSetup(
        micro_batch=draw(st.integers(1, 4)), seq_len=draw(st.integers(1, 16)), grad_accum=draw(st.integers(1, 3)),
        steps=draw(st.integers(1, 3)), precision=precision,
        fp32_grads=precision == "bf16-mixed" and engine != "fsdp2" and draw(st.booleans()),
        optimizer=draw(st.sampled_from(["sgd", "sgd-momentum", "adam", "adamw", "amsgrad", "adam-8bit"])),
        optimizer_impl=draw(st.sampled_from(["foreach", "for-loop", "fused"])),
        set_to_none=draw(st.booleans()), world_size=draw(st.sampled_from([1, 2, 3])),
        dp_engine=engine, zero_stage=draw(st.integers(0, 3)) if engine == "deepspeed" else 0,
        reshard_after_forward=draw(st.booleans()), backward_prefetch=draw(st.integers(0, 2)),
        forward_prefetch=draw(st.integers(0, 2)), reduce_bucket_size=draw(st.sampled_from([7, 500_000_000])),
        stage3_param_persistence_threshold=draw(st.sampled_from([0, 100_000])),
        stage3_prefetch_bucket_size=draw(st.sampled_from([10, 50_000_000])),
        checkpointing=draw(st.sampled_from(["none", "full"])))
    return model, setup


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_run_invariants(case):
    model, setup = case
    log = simulate(describe(model, setup))
    tl = timeline(log)
    assert min(int(v) for v in tl.total) >= 0
    assert all(min(int(v) for v in col) >= 0 for col in tl.by_category.values())
    live = {}
    for e in log.events:
        if e.action is Action.ALLOC:
            assert e.block.id not in live
            live[e.block.id] = e.block
        else:
            del live[e.block.id]
    # the caller holds the batch until its backward is over
    assert all(e.op == "batch.release" for e in log.events
               if e.action is Action.FREE and e.block.category is Category.INPUT)
    # engines keep their buckets, DeepSpeed its gradient partition, FSDP2 its last all-gather output
    kept_grads = (
        not setup.optimizer.set_to_none or setup.precision.fp32_grads or setup.data_parallel.deepspeed.zero_stage >= 2
    )
    # and a GPU's cuBLAS handles their workspaces (models/gpu.py)
    allowed_at_end = PERSISTENT | {Category.REDUCE_SCATTER_BUCKET, Category.ALL_GATHER_BUFFER, Category.WORKSPACE} | \
        ({Category.GRADIENT} if kept_grads else set())
    assert {b.category for b in live.values()} <= allowed_at_end
    report = summarize(log)
    if report.peaks.steady is not None:
        assert report.peaks.overall.bytes >= report.peaks.steady.bytes
    assert report.peaks.overall.bytes >= report.peaks.first_step.bytes
    again = summarize(simulate(describe(model, setup)))
    assert json.dumps(report_json(report)) == json.dumps(report_json(again))
