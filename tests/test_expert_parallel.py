"""Expert parallelism (models/parallel/expert.py) against real gloo runs of HF Mixtral under torchtitan's token
dispatch (traces/expert_run.py), the routing's effect on each rank, and the refusals.

Every expected number comes from a run, from torchtitan's own index fill (`permute_indices`, the harness's) or
from the routing input; never from a constant.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from peakledger.analysis.validate import compare_logs, static_rows
from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup, TransformerConfig
from peakledger.models.moe import routing_counts
from peakledger.models.parallel.expert import padded_rows, received
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.timeline import timeline

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from peakledger.traces.expert_run import measure_expert_parallel, permute_indices  # noqa: E402

TINY = TransformerConfig(name="tiny-mixtral", architecture="llama", implementation="hf", n_layer=2, d_model=64,
                         n_head=4, n_kv_head=2, d_ff=96, vocab_size=256, max_seq_len=64, num_local_experts=4,
                         num_experts_per_tok=2)
TOLERANCE = 1e-4
DDP_UNMODELLED = 8  # bytes: DDP's construction leaves an 8-byte int64 tensor that goes in the first backward


def _setup(ep: int, **kw) -> TrainingSetup:
    return TrainingSetup(micro_batch=2, seq_len=32, optimizer="adamw", steps=2, world_size=ep, ep=ep, dp_engine="ddp",
                         **{"precision": "fp32", **kw})


def _compare(measured, counts, setup, tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(counts))
    routed = setup.replace(moe_routing=f"counts:{path}")
    graph = describe(TINY, routed, "cpu", ranks=list(range(setup.mesh.world_size)), all_steps=True)
    simulated = simulate(graph)
    for rank, log in enumerate(measured):
        v = compare_logs(log, simulated, rank=rank)
        assert abs(v.overall.error) <= TOLERANCE, (rank, v.overall, v.unexplained[:3])
        for phase in v.phases:
            if phase.label.startswith(("forward", "optimizer")):
                assert phase.measured == phase.predicted, (rank, phase)
            elif phase.label.startswith("backward"):
                assert 0 <= phase.measured - phase.predicted <= DDP_UNMODELLED, (rank, phase)
        assert static_rows(log, rank) == static_rows(simulated, rank)
    return graph, simulated


@pytest.mark.parametrize("routing", ["measured", "worst"])
def test_real_expert_parallel_ranks_match_the_simulation(routing, tmp_path):
    setup = _setup(2)
    measured, counts = measure_expert_parallel(TINY, setup, routing=routing)
    graph, simulated = _compare(measured, counts, setup, tmp_path)
    rows = graph.metadata.expert_parallel["received_rows"]
    for rank in range(2):  # what each rank received is what the recorded routing sends its experts
        assert rows[str(rank)] == [2 * sum(layer[2 * rank:2 * rank + 2]) for layer in counts["layers"]]
    if routing == "worst":  # every token to the same two experts: one rank gets all rows, and the larger peak
        busy = max(range(2), key=lambda r: rows[str(r)][0])
        assert rows[str(busy)] == [2 * 2 * 64] * 2 and rows[str(1 - busy)] == [0, 0]
        peaks = [timeline(log, r).peak().bytes for r, log in enumerate(measured)]
        assert peaks[busy] > peaks[1 - busy]


def test_real_expert_parallel_bf16_one_expert_a_rank(tmp_path):
    setup = _setup(4, precision="bf16")
    measured, counts = measure_expert_parallel(TINY, setup)
    _compare(measured, counts, setup, tmp_path)


def test_real_expert_parallel_with_expert_replicas(tmp_path):
    """dp 4, ep 2: ranks r and r + 2 hold the same experts (Megatron's layout) and average their gradients."""
    setup = _setup(2).replace(world_size=4)
    measured, counts = measure_expert_parallel(TINY, setup)
    graph, _ = _compare(measured, counts, setup, tmp_path)
    assert [log.metadata.ep_rank for log in measured] == [0, 1, 0, 1]
    assert (graph.metadata.expert_parallel["received_rows"]["2"]
            == graph.metadata.expert_parallel["received_rows"]["0"])


def test_the_routing_sizes_each_ranks_rows():
    """Balanced: every rank receives what it sends (one class of ranks); worst: rank 0, owning experts 0..k-1,
    receives every rank's rows, the others none (their buffers are torchtitan's padding alone)."""
    sent = 2 * 32 * TINY.num_experts_per_tok
    balanced = describe(TINY, _setup(2, moe_routing="balanced"), "cpu")
    assert list(balanced.metadata.rank_classes) == ["0"]
    assert balanced.metadata.expert_parallel["received_rows"]["0"] == [sent, sent]
    worst = describe(TINY, _setup(2, moe_routing="worst"), "cpu")
    assert worst.metadata.expert_parallel["received_rows"] == {"0": [2 * sent] * 2, "1": [0, 0]}
    log = simulate(worst)
    assert timeline(log, 0).peak().bytes > timeline(log, 1).peak().bytes


@pytest.mark.parametrize("got", [[29, 35, 27, 37], [0, 0, 64, 64], [0, 0, 0, 0], [5, 0, 3, 1, 0, 0, 9, 2]])
def test_the_permute_buffer_is_torchtitans(got):
    ep = 2
    indices, offsets = permute_indices(got, ep, len(got) // ep)
    assert padded_rows(got, ep) == len(indices)
    assert offsets[-1] <= len(indices) and sorted(i for i in indices if i >= 0) == list(range(sum(got)))


def test_received_rows_follow_the_routing_counts():
    setup = _setup(2, moe_routing="worst")
    counts = routing_counts(TINY, setup, 0)
    assert sum(received(counts, 2, 0)) + sum(received(counts, 2, 1)) == 2 * sum(counts)


def test_expert_parallel_params_and_counts():
    """A rank holds E / ep experts; the metadata counts the whole model, DDP buckets only the dense parameters."""
    whole = describe(TINY, TrainingSetup(micro_batch=2, seq_len=32, precision="fp32"), "cpu").metadata
    split = describe(TINY, _setup(2), "cpu").metadata
    assert split.n_params == whole.n_params and split.n_trainable == whole.n_trainable
    assert split.expert_parallel["experts_per_rank"] == TINY.num_local_experts // 2


@pytest.mark.parametrize("extra, field", [
    (dict(dp_engine="fsdp2"), "dp_engine"),
    (dict(world_size=4, pp=2, grad_accum=2), "world_size"),
    (dict(lora_r=4), "lora_r"),
])
def test_what_expert_parallelism_is_not_simulated_with(extra, field):
    with pytest.raises(ConfigError) as e:  # (LoRA with a data-parallel engine is refused by the setup itself)
        describe(TINY, _setup(2).replace(**extra), "cpu")
    assert e.value.field == field


def test_eager_experts_are_refused_with_ep():
    with pytest.raises(ConfigError) as e:
        describe(dataclasses.replace(TINY, experts_implementation="eager"), _setup(2), "cpu")
    assert e.value.field == "experts_implementation"


def test_cli_ep_bad_input_exits_2(capsys):
    code = main(["simulate", "--preset", "mixtral-8x7b", "--ep", "8", "--world-size", "8", "--dp-engine", "fsdp2",
                 "--micro-batch", "1", "--seq-len", "512"])
    assert code == 2
    err = capsys.readouterr().err
    assert "dp_engine" in err and "ddp" in err and "Traceback" not in err


def test_cli_ep_reports_the_rows(capsys):
    code = main(["simulate", "--preset", "mixtral-8x7b", "--ep", "8", "--world-size", "8", "--dp-engine", "ddp",
                 "--micro-batch", "1", "--seq-len", "512", "--moe-routing", "worst", "--steps", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "expert parallel: ep 8, 1 experts a rank" in out and "(rank 0 the most)" in out


def test_compare_peers_with_ep(capsys):
    code = main(["compare", "--preset", "mixtral-8x7b", "--ep", "8", "--world-size", "8", "--dp-engine", "ddp",
                 "--micro-batch", "1", "--seq-len", "512", "--steps", "1", "--peers"])
    assert code == 0
    out = capsys.readouterr().out
    assert "experts split over ep 8" in out and "expert parallelism (ep 8) is not passed" in out
    assert out.index("peakledger") < out.index("Megatron-LM theoretical")
