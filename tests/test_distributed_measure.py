"""Real 2-rank CPU runs (gloo on 127.0.0.1) measured rank by rank: the bytes the tracker sees equal what
FSDP2's sharding rule and ZeroRedundancyOptimizer's partition imply for the model, computed here from
the model's own parameter shapes."""

from __future__ import annotations

import math

import pytest
import torch

from peakledger.models.config import TrainingSetup, TransformerConfig
from peakledger.models.reference import build_model
from peakledger.simulator.events import Action, Category, OptimizerState, Phase
from peakledger.traces.distributed import measure_distributed

WORLD = 2
# odd vocabulary and context length: wte (37, 12) and wpe (9, 12) do not split evenly over 2 ranks,
# so the padding rule is exercised; the tied lm_head lives in the root unit with them
ODD_GPT = TransformerConfig(name="odd", family="gpt2", n_layer=1, d_model=12, n_head=2, vocab_size=37,
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
    assert [log.metadata["rank"] for log in fsdp_logs] == list(range(WORLD))
    total = 0
    for log in fsdp_logs:
        shards = blocks_at_load(log, Category.PARAMETER)
        assert set(shards) == set(shapes)
        for name, shape in shapes.items():
            assert shards[name].nbytes == padded_rows(shape, WORLD) * row_numel(shape) * FP32, name
            assert shards[name].shard_factor == WORLD and shards[name].rank == log.metadata["rank"]
        total += sum(b.nbytes for b in shards.values())
    assert total == sum(padded_rows(s, WORLD) * WORLD * row_numel(s) * FP32 for s in shapes.values())
    assert total > sum(numel(s) for s in shapes.values()) * FP32  # this config does pad


def test_fsdp2_gathers_every_unit_on_every_rank_during_forward(fsdp_logs):
    shapes = full_shapes(ODD_GPT)
    for log in fsdp_logs:
        units = log.metadata["fsdp_units"]
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
        rank, units = log.metadata["rank"], log.metadata["fsdp_units"]
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
        rank = log.metadata["rank"]
        assert log.metadata["zero_owner"] == owner
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
