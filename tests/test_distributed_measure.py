"""Real 2-rank CPU runs (gloo on 127.0.0.1) measured rank by rank: the bytes the tracker sees equal what
FSDP2's sharding rule and ZeroRedundancyOptimizer's partition imply for the model, computed here from
the model's own parameter shapes. Every FSDP2 collective returns only once the process group has let go
of its tensors (`BackendReleased`), checked here against a thread that holds them a while."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from peakledger.models.config import TrainingSetup, TransformerConfig
from peakledger.simulator.events import Action, Category, OptimizerState, Phase
from peakledger.traces.distributed import BackendReleased, ReleaseCount, holders, measure_distributed
from peakledger.traces.reference import build_model

WORLD = 2
# odd vocabulary and context length: wte (37, 12) and wpe (9, 12) do not split evenly over 2 ranks,
# so the padding rule is exercised; the tied lm_head lives in the root unit with them
ODD_GPT = TransformerConfig(name="odd", architecture="gpt2", n_layer=1, d_model=12, n_head=2, vocab_size=37,
                            max_seq_len=9, attention="sdpa")
SETUP = TrainingSetup(micro_batch=2, seq_len=8, steps=2, optimizer="adamw", optimizer_impl="foreach")
FP32 = torch.finfo(torch.float32).bits // 8


def full_shapes(cfg) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}


def numel(shape) -> int:
    return math.prod(shape)


def padded_rows(shape, world: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the world size: every rank stores ceil(dim0 / N) rows."""
    return -(-shape[0] // world)


def local_rows(shape, world: int, rank: int) -> int:
    """Rows rank `rank` really owns (the last ranks may own fewer, or none)."""
    per = padded_rows(shape, world)
    return max(0, min(per, shape[0] - rank * per))


def row_numel(shape) -> int:
    return numel(shape[1:])


def blocks_at_load(log, category):
    return {e.block.name: e.block for e in log.events if e.phase is Phase.LOAD and e.block.category is category}


def first_blocks(log, category, step: int):
    """Blocks of `category` allocated during `step`, by name (the first allocation of each name)."""
    out = {}
    for e in log.events:
        if e.action is Action.ALLOC and e.step == step and e.block.category is category:
            out.setdefault(e.block.name, e.block)
    return out


def live_at_end(log, category) -> dict[str, int]:
    live = {}
    for e in log.events:
        if e.block.category is category:
            live[e.block.id] = (e.block, e.action is Action.ALLOC)
    out = {}
    for block, alive in live.values():
        if alive:
            out[block.name] = out.get(block.name, 0) + block.nbytes
    return out


@pytest.fixture(scope="module")
def fsdp_logs():
    return measure_distributed(ODD_GPT, SETUP, WORLD, "fsdp2", reshard_after_forward=True, timeout_s=120)


@pytest.fixture(scope="module")
def zero_logs():
    return measure_distributed(ODD_GPT, SETUP, WORLD, "zero-redundancy-optimizer", timeout_s=120)


def test_fsdp2_shards_are_padded_on_every_rank_and_sum_to_the_padded_model(fsdp_logs):
    shapes = full_shapes(ODD_GPT)
    assert [log.metadata.rank for log in fsdp_logs] == list(range(WORLD))
    total = 0
    for log in fsdp_logs:
        shards = blocks_at_load(log, Category.PARAMETER)
        assert set(shards) == set(shapes)
        for name, shape in shapes.items():
            assert shards[name].nbytes == padded_rows(shape, WORLD) * row_numel(shape) * FP32, name
            assert shards[name].shard_factor == WORLD and shards[name].rank == log.metadata.rank
        total += sum(b.nbytes for b in shards.values())
    assert total == sum(padded_rows(s, WORLD) * WORLD * row_numel(s) * FP32 for s in shapes.values())
    assert total > sum(numel(s) for s in shapes.values()) * FP32  # this config does pad


def test_fsdp2_gathers_every_unit_on_every_rank_during_forward(fsdp_logs):
    shapes = full_shapes(ODD_GPT)
    for log in fsdp_logs:
        units = log.metadata.fsdp_units
        gathers = first_blocks(log, Category.ALL_GATHER_BUFFER, step=1)
        forward_gathers = {e.block.name for e in log.events
                           if e.phase is Phase.FORWARD and e.block.category is Category.ALL_GATHER_BUFFER}
        assert {f"{u}.all_gather_output" for u in units} <= forward_gathers
        for unit, params in units.items():
            padded_unit = sum(padded_rows(shapes[p], WORLD) * row_numel(shapes[p]) for p in params) * FP32
            assert gathers[f"{unit}.all_gather_output"].nbytes == WORLD * padded_unit
        unsharded = first_blocks(log, Category.PARAMETER, step=1)
        for name, shape in shapes.items():  # the unsharded parameter: padded rows of all ranks
            assert unsharded[f"{name}.unsharded"].nbytes == padded_rows(shape, WORLD) * WORLD * row_numel(shape) * FP32


def test_fsdp2_grads_are_the_reduce_scatter_outputs_and_state_is_the_unpadded_local_shard(fsdp_logs):
    shapes = full_shapes(ODD_GPT)
    for log in fsdp_logs:
        rank, units = log.metadata.rank, log.metadata.fsdp_units
        grads = first_blocks(log, Category.GRADIENT, step=2)
        buckets = first_blocks(log, Category.REDUCE_SCATTER_BUCKET, step=2)
        for unit, params in units.items():
            padded_unit = sum(padded_rows(shapes[p], WORLD) * row_numel(shapes[p]) for p in params) * FP32
            assert grads[f"{unit}.reduce_scatter_output"].nbytes == padded_unit
            assert buckets[f"{unit}.reduce_scatter_input"].nbytes == WORLD * padded_unit
        state = {}
        for e in log.events:
            if e.action is Action.ALLOC and e.block.category is Category.OPTIMIZER_STATE:
                state[(e.block.name.rpartition(".")[0], e.block.state)] = e.block.nbytes
        for name, shape in shapes.items():
            local = local_rows(shape, WORLD, rank) * row_numel(shape) * FP32
            assert state.get((name, OptimizerState.EXP_AVG), 0) == local, name  # 0 bytes: never allocated
            assert state.get((name, OptimizerState.EXP_AVG_SQ), 0) == local, name
            assert state[(name, OptimizerState.STEP)] == FP32  # one unsharded fp32 scalar per parameter


def zero_partition(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, int]:
    """ZeroRedundancyOptimizer's rule: largest parameter first, each to the rank holding fewest elements."""
    sizes = [0] * world
    owner = {}
    for name in sorted(shapes, key=lambda n: numel(shapes[n]), reverse=True):
        rank = sizes.index(min(sizes))
        owner[name] = rank
        sizes[rank] += numel(shapes[name])
    return owner


def test_zero_state_follows_the_greedy_partition_and_params_and_grads_are_replicated(zero_logs):
    shapes = full_shapes(ODD_GPT)
    owner = zero_partition(shapes, WORLD)
    full = sum(numel(s) for s in shapes.values()) * FP32
    for log in zero_logs:
        rank = log.metadata.rank
        assert log.metadata.zero_owner == owner
        assert sum(b.nbytes for b in blocks_at_load(log, Category.PARAMETER).values()) == full
        mine = [n for n, r in owner.items() if r == rank]
        state = live_at_end(log, Category.OPTIMIZER_STATE)
        assert sorted({n.rpartition(".")[0] for n in state}) == sorted(mine)
        assert sum(state.values()) == 2 * sum(numel(shapes[n]) for n in mine) * FP32 + FP32 * len(mine)
        grads_after_backward = {e.block.name: e.block.nbytes for e in log.events
                                if e.step == 2 and e.phase is Phase.BACKWARD and e.action is Action.ALLOC
                                and e.block.category is Category.GRADIENT}
        assert sum(grads_after_backward.values()) == full  # ZeRO-1: every rank holds every gradient


def test_zero_runs_on_ddp_buckets_that_hold_every_gradient(zero_logs):
    shapes = full_shapes(ODD_GPT)
    full = sum(numel(s) for s in shapes.values()) * FP32
    for log in zero_logs:
        at_load = [b for b in blocks_at_load(log, Category.REDUCE_SCATTER_BUCKET).values()]
        assert sum(b.nbytes for b in at_load) == full and all(b.name.startswith("ddp.bucket.") for b in at_load)
        rebuilt = first_blocks(log, Category.REDUCE_SCATTER_BUCKET, step=2)
        assert sum(b.nbytes for b in rebuilt.values()) == full  # rebuilt in the second forward


class LateRelease:
    """A collective whose 'process group' keeps C++ references to its tensors on another thread for
    `hold_s` seconds after returning, as gloo's worker thread does for a moment (ProcessGroupGloo::runLoop)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.released_at: float | None = None

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        held = [output_tensor.detach(), input_tensor.detach()]  # new TensorImpls on the same storage

        def drop():
            time.sleep(self.hold_s)
            self.released_at = time.monotonic()
            held.clear()

        threading.Thread(target=drop).start()
        return None  # synchronous: "completed"


def test_a_collective_returns_only_when_the_process_group_has_let_go_of_its_tensors():
    out = torch.empty(8)
    inp = out[:4]
    before = holders((out, inp))
    late, count = LateRelease(0.05), ReleaseCount()
    BackendReleased.call(late, count, output_tensor=out, input_tensor=inp, group=None, async_op=False)
    assert late.released_at is not None and time.monotonic() >= late.released_at
    assert holders((out, inp)) == before
    assert count == ReleaseCount(collectives=1, waited=1, timeouts=0)


def test_a_collective_never_released_is_counted_not_waited_for_forever(monkeypatch):
    out = torch.empty(8)
    late, count = LateRelease(0.5), ReleaseCount()
    monkeypatch.setattr(BackendReleased, "TIMEOUT_S", 0.02)
    BackendReleased.call(late, count, output_tensor=out, input_tensor=out[:4], group=None, async_op=False)
    assert count == ReleaseCount(collectives=1, waited=1, timeouts=1)


def test_fsdp2_collectives_on_gloo_were_all_released(fsdp_logs):
    for log in fsdp_logs:
        assert log.metadata.backend == "gloo"
        calls = sum(1 for e in log.events if e.action is Action.ALLOC
                    and e.block.name.endswith((".all_gather_output", ".reduce_scatter_input")))
        release = log.metadata.backend_release
        assert release["collectives"] == calls > 0 and release["timeouts"] == 0


def test_an_unknown_backend_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="backend"):
        measure_distributed(ODD_GPT, SETUP, WORLD, "fsdp2", backend="nccl")
